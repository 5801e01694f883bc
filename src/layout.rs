//! KV entry formats, the layer-first region layout, and item layouts (how a
//! row of a KV buffer is addressed).
//!
//! A request's region holds `[layer][token][entry_bytes]`: every layer's
//! tokens are contiguous, so a prefill can write one layer at a time and a
//! fetch of (layer, token) is one multiply-add away from the region base. The
//! GPU-side buffers use the same per-layer row layout, which is what makes a
//! fetch or a writeback plain address arithmetic.

use std::fmt;
use std::str::FromStr;

use crate::abi::{KVT_ITEM_MAX_SCALE_BYTES, kvt_item_layout};
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
/// Most bytes one region may hold (256 TiB): keeps every offset and size
/// computed from a layout far from 64-bit overflow.
pub const MAX_REGION_BYTES: u64 = 1 << 48;

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
        let region = entry_bytes as u128 * layers as u128 * tokens_per_region as u128;
        if region > MAX_REGION_BYTES as u128 {
            return Err(invalid(
                "tokens_per_region",
                format!(
                    "{entry_bytes} B × {layers} layers × {tokens_per_region} tokens is {region} B a region, more \
                     than the {MAX_REGION_BYTES} B (256 TiB) a region may hold"
                ),
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

/// How row `r` of a KV buffer is addressed: a linear buffer of equal rows,
/// or rows grouped in padded pages that keep each row's value and scale in
/// separate runs (DeepSeek-V4's C4 cache). The swap-in copies rows between
/// host and device buffers of one item layout.
///
/// Rows are grouped in pages of `rows_per_page` rows, `page_bytes` apart.
/// Within a page the rows' value pieces come first (`value_bytes` each), then
/// their scale pieces (`scale_bytes` each), then padding. A linear buffer is
/// one row per page, no scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemLayout {
    page_shift: u32,
    value_bytes: u32,
    scale_bytes: u32,
    page_bytes: u64,
}

impl ItemLayout {
    /// Rows per page of DeepSeek-V4's page-padded C4 cache.
    pub const DSV4_PAGE_ROWS: u32 = 64;
    /// Bytes of a C4 token's value (fp8 nope + bf16 rope).
    pub const DSV4_VALUE_BYTES: u32 = 576;
    /// Bytes of a C4 token's scales.
    pub const DSV4_SCALE_BYTES: u32 = 8;

    /// Rows of `item_bytes`, back to back (`item_bytes` a positive multiple of 8).
    pub fn linear(item_bytes: u32) -> Result<Self> {
        Self::paged(1, item_bytes, 0, item_bytes as u64)
    }

    /// Pages of `rows_per_page` rows (a power of two, at most 65536), each row
    /// a value of `value_bytes` and a scale of `scale_bytes` (multiples of 8;
    /// the scale at most 256 bytes, one 8-byte word per lane of a warp), pages
    /// `page_bytes` apart (a multiple of 8 that holds both runs).
    pub fn paged(
        rows_per_page: u32,
        value_bytes: u32,
        scale_bytes: u32,
        page_bytes: u64,
    ) -> Result<Self> {
        if !rows_per_page.is_power_of_two() || rows_per_page > 1 << 16 {
            return Err(invalid(
                "rows_per_page",
                format!("{rows_per_page} is not a power of two in 1..=65536"),
            ));
        }
        if value_bytes == 0 || !value_bytes.is_multiple_of(8) {
            return Err(invalid(
                "item_size_bytes",
                format!("{value_bytes} is not a positive multiple of 8"),
            ));
        }
        if !scale_bytes.is_multiple_of(8) || scale_bytes > KVT_ITEM_MAX_SCALE_BYTES {
            return Err(invalid(
                "scale_bytes",
                format!("{scale_bytes} is not a multiple of 8 in 0..={KVT_ITEM_MAX_SCALE_BYTES}"),
            ));
        }
        let used = (value_bytes as u64 + scale_bytes as u64) * rows_per_page as u64;
        if !page_bytes.is_multiple_of(8) || page_bytes < used {
            return Err(invalid(
                "page_bytes",
                format!(
                    "{page_bytes} is not a multiple of 8 of at least {used} (the page's value and scale runs)"
                ),
            ));
        }
        Ok(ItemLayout {
            page_shift: rows_per_page.trailing_zeros(),
            value_bytes,
            scale_bytes,
            page_bytes,
        })
    }

    /// DeepSeek-V4's page-padded C4 layout (SGLang's `DeepSeekV4PagedHostPool`
    /// and the device C4 cache): pages of 64 rows, each row a 576-byte value
    /// and an 8-byte scale in separate runs, pages padded to a multiple of 576
    /// bytes (37440).
    pub fn dsv4_c4() -> Self {
        let rows = Self::DSV4_PAGE_ROWS as u64;
        let item = (Self::DSV4_VALUE_BYTES + Self::DSV4_SCALE_BYTES) as u64;
        let page_bytes = (item * rows).div_ceil(576) * 576;
        Self::paged(
            Self::DSV4_PAGE_ROWS,
            Self::DSV4_VALUE_BYTES,
            Self::DSV4_SCALE_BYTES,
            page_bytes,
        )
        .expect("the C4 layout is valid")
    }

    /// Bytes a row carries (value and scale).
    pub fn item_bytes(&self) -> u32 {
        self.value_bytes + self.scale_bytes
    }

    /// Rows per page (1 for a linear layout).
    pub fn rows_per_page(&self) -> u32 {
        1 << self.page_shift
    }

    /// Bytes from one page to the next.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// True for a linear layout (one row per page, no scale piece).
    pub fn is_linear(&self) -> bool {
        self.page_shift == 0 && self.scale_bytes == 0
    }

    /// Whole rows a buffer of `bytes` holds (only whole pages count).
    pub fn rows_in(&self, bytes: u64) -> u64 {
        (bytes / self.page_bytes) << self.page_shift
    }

    /// Byte offsets of row `row`'s value and scale pieces (the scale's length
    /// is 0 when the layout has none).
    pub fn pieces(&self, row: u64) -> [(u64, usize); 2] {
        let page = (row >> self.page_shift) * self.page_bytes;
        let within = row & ((1u64 << self.page_shift) - 1);
        let scale_run = (self.value_bytes as u64) << self.page_shift;
        [
            (
                page + within * self.value_bytes as u64,
                self.value_bytes as usize,
            ),
            (
                page + scale_run + within * self.scale_bytes as u64,
                self.scale_bytes as usize,
            ),
        ]
    }

    /// The kernels' form.
    pub fn to_abi(self) -> kvt_item_layout {
        kvt_item_layout {
            page_bytes: self.page_bytes,
            page_shift: self.page_shift,
            value_bytes: self.value_bytes,
            scale_bytes: self.scale_bytes,
            _reserved: 0,
        }
    }
}

impl fmt::Display for ItemLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_linear() {
            write!(f, "rows of {} B", self.value_bytes)
        } else {
            write!(
                f,
                "pages of {} rows ({} B value + {} B scale per row) every {} B",
                self.rows_per_page(),
                self.value_bytes,
                self.scale_bytes,
                self.page_bytes
            )
        }
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
    fn item_layouts() {
        let lin = ItemLayout::linear(656).unwrap();
        assert!(lin.is_linear());
        assert_eq!(lin.rows_in(656 * 10 + 655), 10);
        assert_eq!(lin.pieces(3), [(3 * 656, 656), (4 * 656, 0)]);
        let c4 = ItemLayout::dsv4_c4();
        assert_eq!(c4.page_bytes(), 37_440);
        assert_eq!(c4.item_bytes(), 584);
        assert_eq!(c4.rows_in(2 * 37_440), 128);
        // row 64 + 1: page 1, second row; the scale run starts at 64 * 576
        assert_eq!(
            c4.pieces(65),
            [(37_440 + 576, 576), (37_440 + 36_864 + 8, 8)]
        );
        for (rows, v, s, page) in [
            (3, 8, 0, 24),
            (1, 12, 0, 12),
            (2, 8, 264, 1024),
            (2, 8, 8, 24),
        ] {
            assert!(
                ItemLayout::paged(rows, v, s, page).is_err(),
                "{rows} {v} {s} {page}"
            );
        }
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
