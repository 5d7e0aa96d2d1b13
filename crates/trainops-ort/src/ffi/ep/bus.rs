//! PCI bus ids: how a CUDA ordinal is matched to the hardware device ONNX Runtime discovered.
//! ONNX Runtime keeps its devices in a hash set (no order to rely on) and gives each GPU a
//! `pci_bus_id` metadata entry (`0000:65:00.0`, from sysfs); the driver names each ordinal's
//! bus with `cuDeviceGetPCIBusId` (same form, its own case and domain width). Pure data: the
//! FFI reading and writing of metadata is in `factory.rs`.

/// The metadata key ONNX Runtime and trainops' devices use.
pub const KEY: &core::ffi::CStr = c"pci_bus_id";

/// A PCI address: domain, bus, device, function.
pub type BusId = (u32, u16, u8, u8);

/// Parses `domain:bus:device.function` (hexadecimal, any case; the domain may be omitted or
/// have 4 or 8 digits, as sysfs, the driver and nvidia-smi write it); `None` otherwise.
pub fn parse(text: &str) -> Option<BusId> {
    let text = text.trim();
    let (head, function) = text.rsplit_once('.')?;
    let mut parts: Vec<&str> = head.split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    let [domain, bus, device] = parts.as_slice() else { return None };
    let hex = |s: &str, max: u32| u32::from_str_radix(s, 16).ok().filter(|v| *v <= max && !s.is_empty());
    Some((
        hex(domain, u32::MAX)?,
        u16::try_from(hex(bus, 0xFF)?).ok()?,
        u8::try_from(hex(device, 0x1F)?).ok()?,
        u8::try_from(hex(function, 0x7)?).ok()?,
    ))
}

/// The canonical text of a bus id, as sysfs writes it (`0000:65:00.0`).
pub fn format((domain, bus, device, function): BusId) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}")
}

/// For each CUDA ordinal (its bus id, if the driver gave one), the index of the discovered
/// device with the same bus id, each discovered device used at most once; `None` where there
/// is none (the caller then makes its own device for that ordinal). Never by position.
pub fn match_ordinals(ordinals: &[Option<BusId>], discovered: &[Option<BusId>]) -> Vec<Option<usize>> {
    let mut used = vec![false; discovered.len()];
    ordinals
        .iter()
        .map(|want| {
            let want = (*want)?;
            let at = discovered.iter().enumerate().position(|(i, d)| !used[i] && *d == Some(want))?;
            used[at] = true;
            Some(at)
        })
        .collect()
}

/// The bus id fake device `ordinal` of `count` reports: descending with the ordinal, so that
/// matching by position would pair them wrongly.
pub fn fake(ordinal: u32, count: u32) -> BusId {
    let bus = 0x10u32 + 0x10 * count.saturating_sub(1).saturating_sub(ordinal).min(0xE);
    (0, bus as u16, 0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_sysfs_the_driver_and_nvidia_smi_write() {
        assert_eq!(parse("0000:65:00.0"), Some((0, 0x65, 0, 0)));
        assert_eq!(parse("00000000:65:00.0"), Some((0, 0x65, 0, 0)));
        assert_eq!(parse("0000:B3:1F.7"), Some((0, 0xB3, 0x1F, 7)));
        assert_eq!(parse("b3:00.1\n"), Some((0, 0xB3, 0, 1)));
        assert_eq!(parse("0001:00:02.0"), Some((1, 0, 2, 0)));
        for bad in
            ["", "65:00", "0000:65:00", "0000:165:00.0", "0000:65:20.0", "0000:65:00.8", "x:65:00.0", "0000::00.0"]
        {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(format((0, 0xB3, 0x1F, 7)), "0000:b3:1f.7");
        assert_eq!(parse(&format((3, 0x65, 4, 1))), Some((3, 0x65, 4, 1)));
    }

    #[test]
    fn ordinals_match_by_bus_not_by_position() {
        let a = parse("0000:17:00.0");
        let b = parse("0000:65:00.0");
        let c = parse("0000:ca:00.0");
        // ONNX Runtime lists c, a, b; the driver's ordinals are a, b, c.
        assert_eq!(match_ordinals(&[a, b, c], &[c, a, b]), vec![Some(1), Some(2), Some(0)]);
        // A discovered device without a bus id, and one ordinal ONNX Runtime did not find.
        assert_eq!(match_ordinals(&[a, b], &[None, b]), vec![None, Some(1)]);
        // An ordinal without a bus id is never matched; a device is used once.
        assert_eq!(match_ordinals(&[None, a, a], &[a]), vec![None, Some(0), None]);
        assert_eq!(match_ordinals(&[], &[a]), Vec::<Option<usize>>::new());
    }

    #[test]
    fn fake_bus_ids_descend_and_differ() {
        let ids: Vec<_> = (0..4).map(|o| fake(o, 4)).collect();
        assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
        assert_eq!(fake(0, 1), (0, 0x10, 0, 0));
    }
}
