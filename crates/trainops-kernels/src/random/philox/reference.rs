//! The scalar reference of Philox4x32-10, written from Random123's `philox.h` and the
//! specification's element rule, for tests of the fast paths. It shares no code with them.

/// `(hi, lo)` of the 64-bit product `a * b`.
pub fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// Philox4x32-10 of one counter block under `key`.
pub fn block(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            // The key is bumped before rounds 2..10.
            k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
        }
        let (hi0, lo0) = mulhilo(0xD251_1F53, c[0]);
        let (hi1, lo1) = mulhilo(0xCD9E_8D57, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Fills `out` element by element: element `i` is word `i % 4` of the block of counter
/// `C + i / 4` (mod 2^128). Returns the state with counter `C + ceil(len / 4)`.
pub fn fill(state: &[u32; 6], out: &mut [u32]) -> [u32; 6] {
    let counter =
        u128::from(state[0]) | u128::from(state[1]) << 32 | u128::from(state[2]) << 64 | u128::from(state[3]) << 96;
    let key = [state[4], state[5]];
    let words = |c: u128| [c as u32, (c >> 32) as u32, (c >> 64) as u32, (c >> 96) as u32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = block(words(counter.wrapping_add((i / 4) as u128)), key)[i % 4];
    }
    let next = words(counter.wrapping_add(out.len().div_ceil(4) as u128));
    [next[0], next[1], next[2], next[3], state[4], state[5]]
}
