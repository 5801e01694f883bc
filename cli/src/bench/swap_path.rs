//! Which of SGLang's single-step swap-in entry points the swap-in scenario
//! lays its rows and queries out for (`--swap-path`), and the decode step
//! for a trace (from its header): read by both scenarios and by the loader
//! of SGLang's kernels, so a module of its own.

use kvtier::{ItemLayout, QueryKind};

use super::{Bench, invalid};

/// Which of SGLang 0.5.23's single-step swap-in entry points a run's rows
/// and queries are laid out for (`--swap-path`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum SwapPath {
    /// `load_cache_to_device_buffer_mla`: linear rows of `--entry` bytes,
    /// token queries (DeepSeek-V3.2, GLM).
    #[default]
    Mla,
    /// `load_cache_to_device_buffer_dsv4_mla`: DeepSeek-V4's page-padded C4
    /// rows (a 576-byte value and an 8-byte scale in separate runs of a
    /// 64-row page), token queries.
    Dsv4C4,
    /// `load_blocks_to_device_buffer_mha`: MiniMax-M3's K and V planes of
    /// `--entry` bytes each, queries of [`M3_BLOCK_TOKENS`]-token blocks.
    M3Kv,
}

/// MiniMax-M3's sparse block in tokens (its config's `sparse_block_size`).
pub(super) const M3_BLOCK_TOKENS: u32 = 128;

impl SwapPath {
    /// The name `--swap-path` takes and the JSON's `path` holds.
    pub(super) fn name(self) -> &'static str {
        match self {
            SwapPath::Mla => "mla",
            SwapPath::Dsv4C4 => "dsv4-c4",
            SwapPath::M3Kv => "m3-kv",
        }
    }

    /// Query columns when `--swap-k` is not given: DeepSeek-V3.2's
    /// index_topk (2048 tokens), DeepSeek-V4-Flash's (512 C4 entries),
    /// MiniMax-M3's topk_blocks (16 blocks).
    pub(super) fn default_k(self) -> u32 {
        match self {
            SwapPath::Mla => 2048,
            SwapPath::Dsv4C4 => 512,
            SwapPath::M3Kv => 16,
        }
    }

    pub(super) fn query(self) -> QueryKind {
        match self {
            SwapPath::M3Kv => QueryKind::Blocks {
                block_tokens: M3_BLOCK_TOKENS,
            },
            _ => QueryKind::Tokens,
        }
    }

    /// KV planes a miss copies a row of (MHA's K and V move together).
    pub(super) fn planes(self) -> usize {
        match self {
            SwapPath::M3Kv => 2,
            _ => 1,
        }
    }

    /// The item sizes a run takes: `--entry` (per plane), except for the
    /// C4 layout, whose rows SGLang fixes.
    pub(super) fn entries(self, b: &Bench) -> kvtier::Result<Vec<u32>> {
        match self {
            SwapPath::Mla => b.entries(&["fp8-dsa"]),
            SwapPath::Dsv4C4 if !b.args.entry.is_empty() => Err(invalid(
                "--entry",
                "DeepSeek-V4's C4 rows are fixed (576 B of value and 8 B of scale in separate runs \
                 of a 64-row page): --entry is for --swap-path mla and m3-kv",
            )),
            SwapPath::Dsv4C4 => Ok(vec![ItemLayout::dsv4_c4().item_bytes()]),
            // bf16 K (or V) of the one KV head of 128 a rank holds
            SwapPath::M3Kv => b.entries(&["256"]),
        }
    }

    /// The path a trace's calls take, from its header's query kind and the
    /// bytes a miss moves over every plane (`item`). The header names no
    /// model (a recorded file carries none), so the rule rests on what it
    /// does carry: a block query is only MiniMax-M3's MHA entry point (K and
    /// V, `item` both together), and among token queries only DeepSeek-V4's
    /// C4 rows move 584 B (576 B of value and 8 B of scale); every other
    /// token trace is linear MLA rows.
    pub(super) fn of_trace(block_tokens: u32, item: u64) -> SwapPath {
        if block_tokens > 0 {
            SwapPath::M3Kv
        } else if item == u64::from(ItemLayout::dsv4_c4().item_bytes()) {
            SwapPath::Dsv4C4
        } else {
            SwapPath::Mla
        }
    }

    pub(super) fn layout(self, item: u32) -> kvtier::Result<ItemLayout> {
        match self {
            SwapPath::Dsv4C4 => Ok(ItemLayout::dsv4_c4()),
            _ => ItemLayout::linear(item),
        }
    }
}
