//! Number formatting shared with the Python side, character for character:
//!
//! - [`format_g`]: C's `printf("%.<p>g")` (Python's `"%.9g" % x`): how losses are printed.
//!   `%.9g` of an `f32` (and `%.17g` of an `f64`) round-trips the value, so two runs print
//!   the same lines exactly when their losses are bit-identical;
//! - [`python_repr`]: Python's `repr(float)`: how a checkpoint's metadata writes the
//!   learning rate and the loss scale.

/// The shortest round-trip digits of finite, nonzero `x` and its decimal exponent:
/// `x = 0.d1d2d3... * 10^(exp + 1)`, i.e. `d1.d2d3... * 10^exp`.
fn digits_exp(s: &str) -> (String, i32) {
    // `s` is Rust's `{:e}` form: "-?D(.DDD)?e-?X".
    let s = s.trim_start_matches('-');
    let (mantissa, exp) = s.split_once('e').expect("scientific notation");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    (digits, exp.parse().expect("exponent"))
}

fn sign(x: f64) -> &'static str {
    if x.is_sign_negative() {
        "-"
    } else {
        ""
    }
}

/// Places the decimal point in `digits` (d1.d2d3... * 10^exp) for fixed notation.
fn fixed(digits: &str, exp: i32) -> String {
    if exp < 0 {
        format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
    } else {
        let point = exp as usize + 1;
        if digits.len() <= point {
            format!("{digits}{}", "0".repeat(point - digits.len()))
        } else {
            format!("{}.{}", &digits[..point], &digits[point..])
        }
    }
}

/// `d1[.d2d3...]e±XX` (at least two exponent digits), as C and Python write exponents.
fn scientific(digits: &str, exp: i32) -> String {
    let (first, rest) = digits.split_at(1);
    let mantissa = if rest.is_empty() { first.to_string() } else { format!("{first}.{rest}") };
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

/// C's `%.<precision>g` of `x` (as Python's `"%.<precision>g" % x`): `precision`
/// significant digits (0 counts as 1), rounded to nearest (ties to even on the exact binary
/// value, as glibc and Python do); scientific notation when the exponent is below -4 or not
/// below the precision; trailing zeros and a trailing point removed; `inf`, `-inf`, `nan`.
pub fn format_g(x: f64, precision: usize) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return format!("{}inf", sign(x));
    }
    let p = precision.max(1);
    if x == 0.0 {
        return format!("{}0", sign(x));
    }
    // Rust's `{:.N e}` rounds the exact binary value correctly (ties to even).
    let (digits, exp) = digits_exp(&format!("{:.*e}", p - 1, x));
    let digits = digits.trim_end_matches('0');
    let digits = if digits.is_empty() { "0" } else { digits };
    let body = if exp < -4 || exp >= p as i32 { scientific(digits, exp) } else { fixed(digits, exp) };
    format!("{}{body}", sign(x))
}

/// Python's `repr(x)` of a float: the shortest digits that round-trip, in fixed notation
/// when `1e-4 <= |x| < 1e16` (with `.0` for an integral value), else scientific
/// (`1e-05`, `1.5e+16`); `inf`, `-inf`, `nan`.
pub fn python_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return format!("{}inf", sign(x));
    }
    if x == 0.0 {
        return format!("{}0.0", sign(x));
    }
    // Rust's `{:e}` gives the shortest round-trip digits (the closest to x among them), as
    // Python's repr (David Gay's mode 0).
    let (digits, exp) = digits_exp(&format!("{x:e}"));
    let decpt = exp + 1;
    let body = if -4 < decpt && decpt <= 16 {
        let f = fixed(&digits, exp);
        if f.contains('.') {
            f
        } else {
            f + ".0"
        }
    } else {
        scientific(&digits, exp)
    };
    format!("{}{body}", sign(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected strings: CPython 3.11's `"%.9g" % x` / `"%.17g" % x` / `repr(x)`, pasted.
    #[test]
    fn format_g_is_c_printf() {
        let cases: &[(f64, usize, &str)] = &[
            (4.100992202758789, 9, "4.1009922"),
            (0.0001, 9, "0.0001"),
            (0.00001234, 9, "1.234e-05"),
            (123456789.0, 9, "123456789"),
            (1234567890.0, 9, "1.23456789e+09"),
            (1234567885.0, 9, "1.23456788e+09"),
            (1234567895.0, 9, "1.2345679e+09"),
            (0.5, 1, "0.5"),
            (2.5, 1, "2"),
            (3.5, 1, "4"),
            (1e100, 9, "1e+100"),
            (-1.5e-300, 9, "-1.5e-300"),
            (100.0, 9, "100"),
            (1e9, 9, "1e+09"),
            (999999999.5, 9, "1e+09"),
            (0.1, 17, "0.10000000000000001"),
            (-0.0, 9, "-0"),
            (0.0, 9, "0"),
            (f64::INFINITY, 9, "inf"),
            (f64::NEG_INFINITY, 9, "-inf"),
            (f64::NAN, 9, "nan"),
            (f32::MIN_POSITIVE as f64, 9, "1.17549435e-38"),
            (0.1f32 as f64, 9, "0.100000001"),
            (16777217.0, 9, "16777217"),
            (5e-324, 17, "4.9406564584124654e-324"),
        ];
        for &(x, p, want) in cases {
            assert_eq!(format_g(x, p), want, "%.{p}g of {x:e}");
        }
    }

    #[test]
    fn python_repr_is_cpython() {
        let cases: &[(f64, &str)] = &[
            (0.001, "0.001"),
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (1.0, "1.0"),
            (-2.0, "-2.0"),
            (32768.0, "32768.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (9999999999999998.0, "9999999999999998.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (3e-4, "0.0003"),
            (1.2345e-7, "1.2345e-07"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "nan"),
            (0.1f32 as f64, "0.10000000149011612"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ];
        for &(x, want) in cases {
            assert_eq!(python_repr(x), want, "repr of {x:e}");
        }
    }
}
