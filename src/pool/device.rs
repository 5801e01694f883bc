//! Pool memory devices: what a user names (`anon:8GiB`,
//! `file:/dev/shm/kv0:64GiB`) and the mapping behind it.

use std::fmt;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::str::FromStr;

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, Result, invalid};

/// A memory device a pool lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// Anonymous memory of this process (the embedded default): `anon:8GiB`.
    Anon { bytes: u64 },
    /// A shared file, on tmpfs or hugetlbfs, mapped shared so that several
    /// processes can map the same pool: `file:/dev/shm/kv0:64GiB`. The file is
    /// created, or grown to `bytes`.
    File { path: PathBuf, bytes: u64 },
}

impl DeviceSpec {
    /// Bytes the device provides.
    pub fn bytes(&self) -> u64 {
        match self {
            DeviceSpec::Anon { bytes } | DeviceSpec::File { bytes, .. } => *bytes,
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let usage =
            "expected anon:SIZE or file:PATH:SIZE (e.g. anon:8GiB, file:/dev/shm/kv0:64GiB)";
        let (kind, rest) = s
            .split_once(':')
            .ok_or_else(|| invalid("device", format!("{s:?}: {usage}")))?;
        match kind {
            "anon" => Ok(DeviceSpec::Anon {
                bytes: parse_size(rest)?,
            }),
            "file" => {
                let (path, size) = rest
                    .rsplit_once(':')
                    .filter(|(p, _)| !p.is_empty())
                    .ok_or_else(|| invalid("device", format!("{s:?}: {usage}")))?;
                Ok(DeviceSpec::File {
                    path: PathBuf::from(path),
                    bytes: parse_size(size)?,
                })
            }
            other => Err(invalid(
                "device",
                format!("{other:?} is not a device kind; {usage}"),
            )),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Anon { bytes } => write!(f, "anon:{}", format_size(*bytes)),
            DeviceSpec::File { path, bytes } => {
                write!(f, "file:{}:{}", path.display(), format_size(*bytes))
            }
        }
    }
}

/// Parses `4096`, `64KiB`, `512MiB`, `8GiB`, `1TiB` (binary), `8GB` (decimal),
/// or `8G` (binary).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| invalid("size", format!("{s:?} does not start with a number")))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => {
            return Err(invalid(
                "size",
                format!("{u:?} is not a size unit (use B, KiB, MiB, GiB, TiB)"),
            ));
        }
    };
    let bytes = n
        .checked_mul(mult)
        .ok_or_else(|| invalid("size", format!("{s:?} overflows 64 bits")))?;
    if bytes == 0 {
        return Err(invalid("size", "a device of 0 bytes holds nothing"));
    }
    Ok(bytes)
}

/// `bytes` in the largest binary unit that divides it.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// A mapped device.
pub(crate) struct MappedDevice {
    map: MmapRaw,
    spec: DeviceSpec,
}

impl MappedDevice {
    pub(crate) fn map(spec: &DeviceSpec) -> Result<Self> {
        let bytes = spec.bytes();
        let len = usize::try_from(bytes)
            .map_err(|_| invalid("device", "larger than the address space"))?;
        let map = match spec {
            DeviceSpec::Anon { .. } => {
                let m = MmapOptions::new()
                    .len(len)
                    .map_anon()
                    .map_err(|source| Error::Io {
                        context: format!("mapping {} of anonymous memory", format_size(bytes)),
                        source,
                    })?;
                MmapRaw::from(m)
            }
            DeviceSpec::File { path, .. } => {
                let io = |what: &str| {
                    let context = format!("{what} {}", path.display());
                    move |source| Error::Io { context, source }
                };
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path)
                    .map_err(io("opening"))?;
                if file.metadata().map_err(io("reading the size of"))?.len() < bytes {
                    file.set_len(bytes).map_err(io("growing"))?;
                }
                MmapOptions::new()
                    .len(len)
                    .map_raw(&file)
                    .map_err(io("mapping"))?
            }
        };
        Ok(MappedDevice {
            map,
            spec: spec.clone(),
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn spec(&self) -> &DeviceSpec {
        &self.spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            "anon:8GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Anon { bytes: 8 << 30 }
        );
        assert_eq!(
            "file:/dev/shm/kv0:64GiB".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::File {
                path: "/dev/shm/kv0".into(),
                bytes: 64 << 30
            }
        );
        assert_eq!("anon:4096".parse::<DeviceSpec>().unwrap().bytes(), 4096);
        assert_eq!(
            "anon:2GB".parse::<DeviceSpec>().unwrap().bytes(),
            2_000_000_000
        );
        for bad in [
            "anon",
            "anon:",
            "anon:0",
            "anon:8XB",
            "file:8GiB",
            "file::8GiB",
            "tape:1GiB",
            "anon:99999999999TiB",
        ] {
            let e = bad.parse::<DeviceSpec>();
            assert!(e.is_err(), "{bad} parsed as {e:?}");
        }
    }

    #[test]
    fn sizes_round_trip() {
        for s in ["4000B", "64KiB", "512MiB", "8GiB", "1TiB"] {
            assert_eq!(format_size(parse_size(s).unwrap()), s);
        }
        let spec: DeviceSpec = "file:/tmp/a:b:1GiB".parse().unwrap();
        assert_eq!(spec.to_string(), "file:/tmp/a:b:1GiB");
    }
}
