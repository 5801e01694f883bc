//! KV entry formats and the layer-first region layout.
//!
//! A request's region holds `[layer][token][entry_bytes]`: every layer's
//! tokens are contiguous, so a prefill can write one layer at a time and a
//! fetch of (layer, token) is one multiply-add away from the region base. The
//! GPU-side buffers use the same per-layer row layout, which is what makes a
//! fetch or a writeback plain address arithmetic.

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, invalid};

/// Named KV entry formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryFormat {
    /// SGLang's fp8 DSA entry (DeepSeek-V3.2, GLM-5.x): 512 B fp8 e4m3 latent,
    /// 16 B of f32 scales, 128 B bf16 rope = 656 B.
    Fp8Dsa,
    /// bf16 MLA: 512 latent + 64 rope values, bf16 = 1152 B.
    Bf16Mla,
    /// Any other entry size in bytes (a multiple of 8).
    Bytes(u32),
}

impl EntryFormat {
    /// Entry size in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            EntryFormat::Fp8Dsa => 656,
            EntryFormat::Bf16Mla => 1152,
            EntryFormat::Bytes(n) => n,
        }
    }
}

impl FromStr for EntryFormat {
    type Err = crate::Error;

    /// `fp8-dsa`, `bf16-mla`, or a byte count such as `584`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp8-dsa" | "fp8_dsa" => Ok(EntryFormat::Fp8Dsa),
            "bf16-mla" | "bf16_mla" => Ok(EntryFormat::Bf16Mla),
            n => n.parse::<u32>().map(EntryFormat::Bytes).map_err(|_| {
                invalid(
                    "entry format",
                    format!("{s:?} is neither fp8-dsa, bf16-mla nor a byte count"),
                )
            }),
        }
    }
}

impl fmt::Display for EntryFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryFormat::Fp8Dsa => write!(f, "fp8-dsa (656 B)"),
            EntryFormat::Bf16Mla => write!(f, "bf16-mla (1152 B)"),
            EntryFormat::Bytes(n) => write!(f, "{n} B"),
        }
    }
}

/// Most layers a layout may have (DeepSeek-V3.2 has 61).
pub const MAX_LAYERS: u32 = 4096;

/// The shape of every request region in a pool: entry size, layer count and
/// capacity in tokens, laid out `[layer][token][entry_bytes]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerFirstLayout {
    entry_bytes: u32,
    layers: u32,
    tokens_per_region: u32,
}

impl LayerFirstLayout {
    /// A layout; `entry_bytes` must be a positive multiple of 8, `layers` in
    /// `1..=4096`, `tokens_per_region` in `1..=i32::MAX` (token indices are
    /// int32 on the device).
    pub fn new(entry_bytes: u32, layers: u32, tokens_per_region: u32) -> Result<Self> {
        if entry_bytes == 0 || !entry_bytes.is_multiple_of(8) {
            return Err(invalid(
                "entry_bytes",
                format!(
                    "{entry_bytes} is not a positive multiple of 8 (656, 1152 and 584 are valid)"
                ),
            ));
        }
        if layers == 0 || layers > MAX_LAYERS {
            return Err(invalid(
                "layers",
                format!("{layers} is outside 1..={MAX_LAYERS}"),
            ));
        }
        if tokens_per_region == 0 || tokens_per_region > i32::MAX as u32 {
            return Err(invalid(
                "tokens_per_region",
                format!("{tokens_per_region} is outside 1..={}", i32::MAX),
            ));
        }
        Ok(LayerFirstLayout {
            entry_bytes,
            layers,
            tokens_per_region,
        })
    }

    /// Bytes per KV entry.
    pub fn entry_bytes(&self) -> u32 {
        self.entry_bytes
    }

    /// Layers per region.
    pub fn layers(&self) -> u32 {
        self.layers
    }

    /// Region capacity in tokens.
    pub fn tokens_per_region(&self) -> u32 {
        self.tokens_per_region
    }

    /// Bytes of one layer of a region.
    pub fn layer_bytes(&self) -> u64 {
        self.tokens_per_region as u64 * self.entry_bytes as u64
    }

    /// Bytes of one region.
    pub fn region_bytes(&self) -> u64 {
        self.layers as u64 * self.layer_bytes()
    }

    /// Byte offset of (layer, token) inside a region.
    pub fn entry_offset(&self, layer: u32, token: u32) -> Result<u64> {
        self.check_layer(layer)?;
        if token >= self.tokens_per_region {
            return Err(invalid(
                "token",
                format!(
                    "{token} is beyond the region capacity of {} tokens",
                    self.tokens_per_region
                ),
            ));
        }
        Ok(layer as u64 * self.layer_bytes() + token as u64 * self.entry_bytes as u64)
    }

    /// Byte offset of `layer` inside a region.
    pub fn layer_offset(&self, layer: u32) -> Result<u64> {
        self.check_layer(layer)?;
        Ok(layer as u64 * self.layer_bytes())
    }

    fn check_layer(&self, layer: u32) -> Result<()> {
        if layer >= self.layers {
            return Err(invalid(
                "layer",
                format!("{layer} is beyond the layout's {} layers", self.layers),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_formats() {
        assert_eq!(EntryFormat::Fp8Dsa.bytes(), 656);
        assert_eq!(EntryFormat::Bf16Mla.bytes(), 1152);
        assert_eq!("584".parse::<EntryFormat>().unwrap().bytes(), 584);
        assert_eq!(
            "fp8-dsa".parse::<EntryFormat>().unwrap(),
            EntryFormat::Fp8Dsa
        );
        assert!("fp9".parse::<EntryFormat>().is_err());
    }

    #[test]
    fn rejects_bad_shapes() {
        for (e, l, t) in [
            (0, 1, 1),
            (12, 1, 1),
            (656, 0, 1),
            (656, 4097, 1),
            (656, 1, 0),
            (656, 1, u32::MAX),
        ] {
            assert!(LayerFirstLayout::new(e, l, t).is_err(), "{e} {l} {t}");
        }
        let err = LayerFirstLayout::new(650, 61, 10).unwrap_err().to_string();
        assert!(
            err.contains("entry_bytes") && err.contains("multiple of 8"),
            "{err}"
        );
    }

    #[test]
    fn offsets_are_layer_first() {
        let l = LayerFirstLayout::new(584, 3, 100).unwrap();
        assert_eq!(l.layer_bytes(), 58_400);
        assert_eq!(l.region_bytes(), 175_200);
        assert_eq!(l.entry_offset(0, 1).unwrap(), 584);
        assert_eq!(l.entry_offset(2, 99).unwrap(), 2 * 58_400 + 99 * 584);
        assert!(l.entry_offset(3, 0).is_err());
        assert!(l.entry_offset(0, 100).is_err());
    }
}
