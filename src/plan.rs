//! What a deployment can hold: the bytes a sparse-attention model keeps per
//! token on each tier under SGLang's HiSparse, and, for a machine, how many
//! requests fit and which resource runs out first (`kvtier plan`).
//!
//! Per request of `L` tokens, with `E = ceil(L / tokens_per_entry)` stored
//! entries (one per token, one per four for DeepSeek-V4's compressed
//! layers):
//!
//! - host (DRAM or CXL): `offloaded_layers × entry_bytes × E`, the whole KV;
//! - HBM: the indexer's keys for the whole context,
//!   `indexer_layers × indexer_entry_bytes × E`, plus the request's HOT
//!   buffer, `offloaded_layers × entry_bytes × slots`, where `slots` is `E`
//!   rounded up to a page for a request that fits the buffer, else the
//!   buffer's `hot` slots and one page more for the newest tokens (SGLang's
//!   `padded_buffer_size`), plus layers kept whole in HBM (DeepSeek-V4's
//!   compressed-by-128 ones), `layers × entry_bytes × ceil(L /
//!   tokens_per_entry)` each, plus a fixed `hbm_bytes_per_request`;
//! - the host link, per decode step: each request longer than its HOT
//!   buffer misses `miss_rate × top_k` entries per offloaded layer, each
//!   `entry_bytes` moved from the host.
//!
//! Every GPU holds the KV of its own requests; under attention tensor
//! parallelism (`tp` > 1) each of a request's `tp` GPUs holds its own part
//! (for MLA a full copy: its KV is replicated across tensor-parallel ranks;
//! for MiniMax-M3 one of its four KV heads, so its bytes above are a
//! rank's), and each rank's host pool is its own, so a node serves `gpus /
//! tp` times the requests one GPU holds, and its host memory holds `gpus`
//! times that GPU's set.
//!
//! A model without HiSparse (DeepSeek-V4.1 under SGLang 0.5.23) keeps its
//! whole KV in HBM (`offloaded_layers` 0: no host KV, no link traffic). A
//! model with static tables (`table_bytes`, DeepSeek-V4.1's Engram tables)
//! has them where the deployment says ([`TablePlacement`]): in HBM,
//! sharded over each server instance's GPUs (its TP group: `tp`, or more
//! with DP attention), `table_bytes / instance_gpus` a GPU off its HBM for
//! KV; in host memory once per instance, `gpus / instance_gpus ×
//! table_bytes` off the node's host memory; or once a node, `table_bytes`
//! off it.
//!
//! Requests per GPU are then the least of: HBM for KV (less the tables'
//! share) over HBM per request; the node's host memory (less the tables)
//! over `gpus ×` host bytes per request (0 when the tables alone do not
//! fit); the link's
//! bytes in `link_budget × step_ms` over the missed bytes per request per
//! step; and, where CXL devices' bandwidth is given, their combined
//! bandwidth (the share of the misses they serve is their share of the host
//! bytes) in the same time over the node's missed bytes per request.

//!
//! With prices ([`Prices`], any one currency; [`cost`]): a node's cost an
//! hour is `gpus × gpu_hour + DRAM GiB × dram_gib_hour` (`+ CXL GiB ×
//! cxl_gib_hour` with CXL), the memory priced for the KV share it holds;
//! at `max_requests` requests decoding one token per step the node makes
//! `max_requests × 3.6e6 / step_ms` tokens an hour, so a million tokens cost
//! `node_per_hour × 1e6 / tokens_per_hour`. Against recomputing: a context
//! token dropped and re-prefilled costs `gpu_hour / 3600 /
//! prefill_tokens_per_s` of GPU time, and kept on a host tier `tp ×
//! host_bytes_per_token / 2^30 × gib_hour` an hour (each of a request's
//! `tp` GPUs keeps its own copy), so keeping it is the cheaper while it is
//! reused within `recompute / keep` hours.

use crate::error::{Result, invalid};

/// A model as its KV lives under HiSparse.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub name: String,
    /// Layers whose KV the host holds (for DeepSeek-V4: the compressed-by-4
    /// layers; MiniMax-M3: its sparse layers).
    pub offloaded_layers: u32,
    /// Bytes of one stored KV entry of one layer, as SGLang's HiSparse host
    /// pool stores it.
    pub entry_bytes: u32,
    /// Sequence tokens per stored entry (1; 4 for DeepSeek-V4's C4 layers).
    pub tokens_per_entry: u32,
    /// Layers with an indexer, and the bytes of its key per stored entry,
    /// kept in HBM for the whole context.
    pub indexer_layers: u32,
    pub indexer_entry_bytes: u32,
    /// Entries the indexer selects per layer and decode step.
    pub top_k: u32,
    /// HOT buffer slots per request (SGLang's default `device_buffer_size`:
    /// twice the `top_k` of `--hisparse-config`, 2048 by default).
    pub hot_slots: u32,
    /// The device pool's page, in entries (the HOT buffer is padded by one).
    pub page_entries: u32,
    /// The longest context the model takes, in tokens.
    pub max_context: u64,
    /// Layers whose whole KV stays in HBM under HiSparse (DeepSeek-V4's
    /// compressed-by-128 layers): (layers, bytes per entry, tokens per entry).
    pub resident_layers: Vec<(u32, u32, u32)>,
    /// HBM a request takes whatever its length (DeepSeek-V4's sliding-window
    /// KV and compressor state).
    pub hbm_bytes_per_request: u64,
    /// Static tables the model reads every step whatever the requests
    /// (DeepSeek-V4.1's Engram tables), in bytes for one copy; where they
    /// live is the deployment's [`TablePlacement`].
    pub table_bytes: u64,
    /// The attention TP sizes SGLang's HiSparse serves the model at (empty:
    /// any). MiniMax-M3's needs one KV head a rank.
    pub attention_tp: Vec<u32>,
    /// Where the numbers come from.
    pub source: String,
}

impl ModelSpec {
    /// The built-in models: those whose every number could be read from a
    /// primary source (the model's published configuration and SGLang's
    /// storage layout). Others are described with a model file.
    pub fn presets() -> Vec<ModelSpec> {
        let dsa = |name: &str, entry: u32, dtype: &str| ModelSpec {
            name: name.into(),
            offloaded_layers: 61,
            entry_bytes: entry,
            tokens_per_entry: 1,
            indexer_layers: 61,
            indexer_entry_bytes: 132,
            top_k: 2048,
            hot_slots: 4096,
            page_entries: 64,
            max_context: 163_840,
            resident_layers: Vec::new(),
            hbm_bytes_per_request: 0,
            table_bytes: 0,
            attention_tp: Vec::new(),
            source: format!(
                "DeepSeek's inference/config_671B_v3.2.json (61 layers, kv_lora_rank 512, qk_rope_head_dim \
                 64, index_head_dim 128, index_topk 2048) and inference/model.py (4096 × rope_factor 40 = \
                 163840 tokens); SGLang 0.5.23's DSA layout ({dtype}: {entry} B per token and layer) and \
                 index keys (128 fp8 + one 4 B scale = 132 B)"
            ),
        };
        // GLM-5 and GLM-5.1 (the same numbers): SGLang 0.5.23 serves
        // GlmMoeDsaForCausalLM as a DeepSeek DSA model (is_deepseek_dsa), so
        // its KV is stored as DeepSeek-V3.2's, per layer.
        let glm = |name: &str, entry: u32, dtype: &str| ModelSpec {
            name: name.into(),
            offloaded_layers: 78,
            indexer_layers: 78,
            max_context: 202_752,
            source: format!(
                "zai-org/GLM-5's and GLM-5.1's config.json (78 layers, kv_lora_rank 512, qk_rope_head_dim \
                 64, index_head_dim 128, index_topk 2048, max_position_embeddings 202752; as copied in \
                 ai-dynamo/aiconfigurator's model_configs at 095f58a); SGLang 0.5.23 stores them as \
                 DeepSeek's DSA ({dtype}: {entry} B per token and layer; index keys 132 B)"
            ),
            ..dsa(name, entry, dtype)
        };
        // DeepSeek-V4 under SGLang 0.5.23's HiSparse: only the
        // compressed-by-4 (C4) layers go to the host (HiSparseC4DevicePool),
        // 584 B entries padded to 585 B in 64-entry pages, one per 4 tokens;
        // their indexer keys (132 B an entry) stay in HBM, and the HOT
        // buffer holds 4096 C4 entries plus a 64-entry page. The
        // compressed-by-128 layers stay in HBM (2-entry pages padded to
        // 1728 B: 864 B an entry). A request also holds, whatever its
        // length, its sliding-window KV (the 768 tokens the pool reserves a
        // request: window 128, eviction interval 128 and two 256-token pages)
        // in every layer at 585 B a token, the C4 compressor's ring state
        // (320 B a window token a C4 layer) and the C128 compressor's state
        // (512 KiB a C128 layer).
        let v4 = |name: &str, layers: u32, c4: u32, c128: u32, topk: u32| {
            let window_tokens = 768u64;
            ModelSpec {
                name: name.into(),
                offloaded_layers: c4,
                entry_bytes: 585,
                tokens_per_entry: 4,
                indexer_layers: c4,
                indexer_entry_bytes: 132,
                top_k: topk,
                hot_slots: 4096,
                page_entries: 64,
                max_context: 1 << 20,
                resident_layers: vec![(c128, 864, 128)],
                hbm_bytes_per_request: window_tokens * 585 * layers as u64
                    + window_tokens * 320 * c4 as u64
                    + (512 << 10) * c128 as u64,
                table_bytes: 0,
                attention_tp: Vec::new(),
                source: format!(
                    "the {name} config.json (num_hidden_layers {layers}: {c4} compressed by 4, {c128} by 128, \
                     the rest sliding-window only; index_topk {topk}; max_position_embeddings 1048576; as \
                     copied in ai-dynamo/aiconfigurator's model_configs at 095f58a); SGLang 0.5.23's \
                     DeepSeek-V4 pool and HiSparse coordinator (C4 layers offloaded, 585 B an entry of 4 \
                     tokens; C128 layers resident, 864 B an entry of 128; indexer keys 132 B a C4 entry; \
                     HOT 4096 + 64 C4 entries; per request a 768-token window in every layer and the \
                     compressors' state)"
                ),
            }
        };
        // DeepSeek-V4.1-Flash under SGLang 0.5.23: HiSparse is refused for
        // it (arg_groups/deepseek_v4_hook.py), so its KV stays in HBM, where
        // only the kv_source_layer_ids layers (2, 8, 14: one entry per 2
        // tokens; 20: one a token) store compressed KV, 585 B an entry on
        // Hopper's layout, each with its 68 B fp4 indexer key; the layers
        // after each read its entries. A request also holds a 768-token
        // window in all 40 layers at 585 B and 24 KiB of pair state. Its two
        // Engram tables (layers 1 and 14) are the host's part: 384006168 and
        // 384016682 rows of 256 fp8 values and 8 e8m0 scales (264 B).
        let v41_flash = || {
            ModelSpec {
            name: "deepseek-v4.1-flash".into(),
            offloaded_layers: 0,
            entry_bytes: 0,
            tokens_per_entry: 1,
            indexer_layers: 0,
            indexer_entry_bytes: 0,
            top_k: 0,
            hot_slots: 0,
            page_entries: 0,
            max_context: 1 << 20,
            resident_layers: vec![(3, 585 + 68, 2), (1, 585 + 68, 1)],
            hbm_bytes_per_request: 768 * 40 * 585 + 3 * 2 * 4096,
            table_bytes: (384_006_168 + 384_016_682) * 264,
            attention_tp: Vec::new(),
            source: "DeepSeek-V4.1-Flash's config (num_hidden_layers 40, compress_ratios, kv_source_layer_ids \
                     [2, 8, 14, 20], engram layers [1, 14], engram_num_embeddings [384006168, 384016682], \
                     max_position_embeddings 1048576; as in LivingAgile/mlx-lm's tests/test_deepseek_v41.py); \
                     SGLang 0.5.23 refuses HiSparse for it, so its KV stays in HBM (source layers only: 585 B \
                     an entry on Hopper plus a 68 B fp4 index key; a 768-token window in every layer; 24 KiB \
                     of pair state), and its Engram tables (264 B a row: 256 B e4m3 + 8 B e8m0) go to HBM \
                     or, with SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE, to host memory"
                .into(),
        }
        };
        // MiniMax-M3 under SGLang 0.5.23's HiSparse: its 57 sparse layers
        // (sparse_attention_freq) go to the host, K and V of the one KV head
        // a rank holds (the coordinator requires one: attention TP 4, or 8
        // with the 4 heads replicated), so an entry is per rank; their index
        // keys (128 values, K only) stay in HBM, as do the 3 dense layers'
        // K and V. Top-k is 16 blocks of 128 tokens; the HOT buffer 2 ×
        // 2048 slots plus a 128-token page. Each request slot also holds
        // its int64 host-location row for the longest context (8 B a
        // token of 1M + 128).
        let m3 = |name: &str, kv: u32, index: u32, dtype: &str| ModelSpec {
            name: name.into(),
            offloaded_layers: 57,
            entry_bytes: kv,
            tokens_per_entry: 1,
            indexer_layers: 57,
            indexer_entry_bytes: index,
            top_k: 2048,
            hot_slots: 4096,
            page_entries: 128,
            max_context: 1 << 20,
            resident_layers: vec![(3, kv, 1)],
            hbm_bytes_per_request: 8 * ((1 << 20) + 128),
            table_bytes: 0,
            attention_tp: vec![4, 8],
            source: format!(
                "MiniMaxAI/MiniMax-M3's config.json (60 layers: 3 dense, 57 sparse; 4 KV heads of 128; \
                 index_head_dim 128; topk_blocks 16 of 128 tokens; max_position_embeddings 1048576; as \
                 copied in ai-dynamo/aiconfigurator's model_configs at 095f58a); SGLang 0.5.23's HiSparse \
                 for it ({dtype}: K and V of the rank's one head, {kv} B a token and layer; index keys \
                 {index} B; HOT 4096 + 128; pages of 128). SGLang sizes the host pool at \
                 host_to_device_ratio (default 2) × the device pool: raise it to use more host memory"
            ),
        };
        vec![
            dsa(
                "deepseek-v3.2",
                656,
                "fp8: 512 nope + 4 scales × 4 B + 64 rope × 2 B",
            ),
            dsa("deepseek-v3.2-bf16", 1152, "bf16: 576 × 2 B"),
            glm(
                "glm-5",
                656,
                "fp8: 512 nope + 4 scales × 4 B + 64 rope × 2 B",
            ),
            glm("glm-5-bf16", 1152, "bf16: 576 × 2 B"),
            v4("deepseek-v4-flash", 43, 21, 20, 512),
            v4("deepseek-v4-pro", 61, 30, 31, 1024),
            v41_flash(),
            m3("minimax-m3", 512, 256, "bf16 KV and index keys"),
            m3(
                "minimax-m3-fp8",
                256,
                128,
                "fp8 KV; fp8 index keys (SGLang's choice on Hopper with fp8 KV)",
            ),
        ]
    }

    /// Whether SGLang's HiSparse serves the model (some of its KV on the
    /// host).
    pub fn offloads(&self) -> bool {
        self.offloaded_layers > 0
    }

    pub fn preset(name: &str) -> Result<ModelSpec> {
        ModelSpec::presets()
            .into_iter()
            .find(|m| m.name == name)
            .ok_or_else(|| {
                invalid(
                    "model",
                    format!(
                        "{name:?} is not a built-in model ({}); describe others with --model-file",
                        ModelSpec::presets()
                            .iter()
                            .map(|m| m.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    }

    fn check(&self) -> Result<()> {
        let mut positive = vec![("tokens_per_entry", self.tokens_per_entry)];
        if self.offloads() {
            positive.extend([
                ("entry_bytes", self.entry_bytes),
                ("top_k", self.top_k),
                ("hot_slots", self.hot_slots),
                ("page_entries", self.page_entries),
            ]);
        }
        for (what, v) in positive {
            if v == 0 {
                return Err(invalid(
                    "model",
                    format!("{}: {what} must be positive", self.name),
                ));
            }
        }
        if self
            .resident_layers
            .iter()
            .any(|&(l, e, t)| l == 0 || e == 0 || t == 0)
        {
            return Err(invalid(
                "model",
                format!(
                    "{}: every resident layer set needs layers, entry bytes and tokens per entry",
                    self.name
                ),
            ));
        }
        if self.offloads() && self.top_k > self.hot_slots {
            return Err(invalid(
                "model",
                format!(
                    "{}: top_k {} exceeds the HOT buffer's {} slots",
                    self.name, self.top_k, self.hot_slots
                ),
            ));
        }
        if self.max_context == 0 || self.max_context > MAX_CONTEXT_TOKENS {
            return Err(invalid(
                "model",
                format!(
                    "{}: max_context {} is outside 1..={MAX_CONTEXT_TOKENS} tokens",
                    self.name, self.max_context
                ),
            ));
        }
        // the bytes of one request at the model's longest context, counted
        // wide: a model whose request does not fit 64 bits (2^31 layers of
        // 2 GiB entries) is nonsense, not a host of 0 bytes
        let (host, hbm) = (
            self.host_bytes_wide(self.max_context),
            self.hbm_bytes_wide(self.max_context),
        );
        if host > MAX_PLAN_BYTES as u128 || hbm > MAX_PLAN_BYTES as u128 {
            return Err(invalid(
                "model",
                format!(
                    "{}: one request of {} tokens takes {} B of host memory and {} B of HBM, more than any machine \
                     holds ({MAX_PLAN_BYTES} B); check its layers and entry bytes",
                    self.name, self.max_context, host, hbm
                ),
            ));
        }
        if self.hbm_bytes(1) == 0 {
            return Err(invalid(
                "model",
                format!(
                    "{}: keeps nothing in HBM (no offloaded, indexer or resident layers, no bytes a request)",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    /// Entries stored for `tokens` tokens.
    pub fn entries(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.tokens_per_entry as u64)
    }

    /// Host bytes per sequence token (all offloaded layers).
    pub fn host_bytes_per_token(&self) -> f64 {
        self.offloaded_layers as f64 * self.entry_bytes as f64 / self.tokens_per_entry as f64
    }

    /// HBM bytes per sequence token that grow with the context (the
    /// indexer's keys).
    pub fn hbm_bytes_per_token(&self) -> f64 {
        self.indexer_layers as f64 * self.indexer_entry_bytes as f64 / self.tokens_per_entry as f64
            + self
                .resident_layers
                .iter()
                .map(|&(l, e, t)| l as f64 * e as f64 / t as f64)
                .sum::<f64>()
    }

    /// HOT buffer slots a request of `tokens` tokens holds in HBM.
    pub fn hot_slots_for(&self, tokens: u64) -> u64 {
        if !self.offloads() {
            return 0;
        }
        let page = self.page_entries as u64;
        self.entries(tokens)
            .next_multiple_of(page)
            .min(self.hot_slots as u64 + page)
    }

    /// Host bytes of one request of `tokens` tokens (`u64::MAX` for more
    /// than 64 bits count: more than any host holds).
    pub fn host_bytes(&self, tokens: u64) -> u64 {
        saturate(self.host_bytes_wide(tokens))
    }

    fn host_bytes_wide(&self, tokens: u64) -> u128 {
        self.offloaded_layers as u128 * self.entry_bytes as u128 * self.entries(tokens) as u128
    }

    /// HBM bytes of one request of `tokens` tokens: its indexer keys and its
    /// HOT buffer (`u64::MAX` for more than 64 bits count).
    pub fn hbm_bytes(&self, tokens: u64) -> u64 {
        saturate(self.hbm_bytes_wide(tokens))
    }

    fn hbm_bytes_wide(&self, tokens: u64) -> u128 {
        self.indexer_layers as u128
            * self.indexer_entry_bytes as u128
            * self.entries(tokens) as u128
            + self.offloaded_layers as u128
                * self.entry_bytes as u128
                * self.hot_slots_for(tokens) as u128
            + self
                .resident_layers
                .iter()
                .map(|&(l, e, t)| l as u128 * e as u128 * tokens.div_ceil(t as u64) as u128)
                .sum::<u128>()
            + self.hbm_bytes_per_request as u128
    }

    /// Bytes one request of `tokens` tokens moves over the host link per
    /// decode step at `miss_rate` (none while it fits its HOT buffer).
    pub fn miss_bytes_per_step(&self, tokens: u64, miss_rate: f64) -> f64 {
        if !self.offloads() || self.entries(tokens) <= self.hot_slots as u64 {
            return 0.0;
        }
        self.offloaded_layers as f64 * miss_rate * self.top_k as f64 * self.entry_bytes as f64
    }
}

/// The longest context a model may give (2^40 tokens): any plot of
/// context lengths, doubling from 4096, reaches it in a few dozen steps.
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 40;

/// The most bytes a plan counts in one place (8 EiB): sums of them stay
/// within 64 bits, and no machine holds more.
pub const MAX_PLAN_BYTES: u64 = 1 << 63;

fn saturate(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

/// A host memory device of the node: capacity for KV, and (for CXL) the
/// read bandwidth it offers, when known.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTier {
    pub name: String,
    pub bytes: u64,
    pub gbps: Option<f64>,
}

/// The machine and how it is used.
#[derive(Clone, Debug, PartialEq)]
pub struct Deployment {
    /// Context lengths in tokens and their shares of the requests.
    pub contexts: Vec<(u64, f64)>,
    pub gpus: u32,
    /// Attention tensor parallelism: GPUs holding a copy of each request's KV.
    pub tp: u32,
    /// HBM per GPU left for KV (HOT buffers and indexer keys) after weights
    /// and activations.
    pub hbm_for_kv: u64,
    /// The node's DRAM for KV.
    pub dram_for_kv: u64,
    /// The node's CXL devices.
    pub cxl: Vec<HostTier>,
    /// Host-to-device bandwidth per GPU, GB/s.
    pub link_gbps: f64,
    /// Share of the top-k that misses the HOT buffer per layer and step.
    pub miss_rate: f64,
    /// A decode step's time, and the share of it the swap-ins may take.
    pub step_ms: f64,
    pub link_budget: f64,
    /// Where the model's static tables live (models with tables only).
    pub tables: TablePlacement,
    /// GPUs of one server instance: its TP group, over which SGLang shards
    /// the tables (None: `tp`, as without DP attention; with DP attention
    /// the engine's TP, `tp ×` the DP size).
    pub instance_gpus: Option<u32>,
}

/// Where a model's static tables (DeepSeek-V4.1's Engram tables) live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TablePlacement {
    /// In HBM, sharded over each instance's TP group (SGLang's default):
    /// each GPU holds `table_bytes / instance_gpus`.
    Hbm,
    /// In host memory, one copy per instance (SGLang's host table, either
    /// layout: "shared" maps one copy, "per_rank" shards one copy).
    HostPerGroup,
    /// In host memory, one copy per node, loaded once and attached by
    /// every instance and restart (kvtier's table store).
    HostShared,
}

impl TablePlacement {
    pub const ALL: [TablePlacement; 3] = [Self::Hbm, Self::HostPerGroup, Self::HostShared];

    pub fn name(self) -> &'static str {
        match self {
            Self::Hbm => "hbm",
            Self::HostPerGroup => "host-per-group",
            Self::HostShared => "host-shared",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Hbm => "in HBM, sharded over each instance's GPUs (SGLang's default)",
            Self::HostPerGroup => "in host memory, a copy per instance (SGLang's host table)",
            Self::HostShared => "in host memory, one copy a node (kvtier's table store)",
        }
    }
}

impl std::str::FromStr for TablePlacement {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                invalid(
                    "tables",
                    format!("{s:?} is not hbm, host-per-group or host-shared"),
                )
            })
    }
}

/// What runs out first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Hbm,
    HostMemory,
    Link,
    CxlBandwidth,
}

impl Limit {
    pub fn name(self) -> &'static str {
        match self {
            Limit::Hbm => "hbm",
            Limit::HostMemory => "host_memory",
            Limit::Link => "link",
            Limit::CxlBandwidth => "cxl_bandwidth",
        }
    }
}

/// The answer for one set of host tiers.
#[derive(Clone, Debug, PartialEq)]
pub struct Capacity {
    /// "DRAM only" or "DRAM + CXL".
    pub tiers: String,
    pub host_bytes: u64,
    /// Requests per GPU each resource allows (None: not a limit here).
    pub per_gpu: Vec<(Limit, Option<u64>)>,
    /// Requests the node serves at once, and what binds.
    pub max_requests: u64,
    pub limited_by: Limit,
    /// Per GPU at `max_requests`: bytes over the link per decode step, and
    /// their time as a share of the step.
    pub link_bytes_per_step: f64,
    pub link_share: f64,
}

/// The answer for a deployment.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub model: ModelSpec,
    pub host_bytes_per_token: f64,
    pub hbm_bytes_per_token: f64,
    /// Averages over the context mix, per request.
    pub host_bytes_per_request: f64,
    pub hbm_bytes_per_request: f64,
    /// Without CXL, then with it (when the node has any).
    pub capacities: Vec<Capacity>,
    /// The model's static tables: HBM they take per GPU, and host memory
    /// per node, where the deployment places them.
    pub table_hbm_per_gpu: u64,
    pub table_host_bytes: u64,
}

impl Deployment {
    /// GPUs of one server instance (`instance_gpus`, else `tp`).
    pub fn instance_gpus(&self) -> u32 {
        self.instance_gpus.unwrap_or(self.tp)
    }

    fn check(&self, model: &ModelSpec) -> Result<()> {
        if self.contexts.is_empty() {
            return Err(invalid("context", "give at least one context length"));
        }
        for &(t, w) in &self.contexts {
            if t == 0 || !(w.is_finite() && w > 0.0) {
                return Err(invalid("context", format!("{t} tokens with weight {w}")));
            }
            if t > model.max_context {
                return Err(invalid(
                    "context",
                    format!(
                        "{t} tokens is past {}'s {} tokens",
                        model.name, model.max_context
                    ),
                ));
            }
        }
        if self.gpus == 0 || self.tp == 0 || !self.gpus.is_multiple_of(self.tp) {
            return Err(invalid(
                "tp",
                format!("{} GPUs in groups of {}", self.gpus, self.tp),
            ));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.link_gbps) || !positive(self.step_ms) || !positive(self.link_budget) {
            return Err(invalid(
                "link",
                "link bandwidth, step time and link budget must be positive",
            ));
        }
        let instance = self.instance_gpus();
        if instance == 0 || !instance.is_multiple_of(self.tp) || !self.gpus.is_multiple_of(instance)
        {
            return Err(invalid(
                "instance_gpus",
                format!(
                    "{instance} GPUs an instance: it must be a multiple of the attention TP {} and divide the {} \
                     GPUs",
                    self.tp, self.gpus
                ),
            ));
        }
        if !model.attention_tp.is_empty() && !model.attention_tp.contains(&self.tp) {
            return Err(invalid(
                "tp",
                format!(
                    "{} is served at attention TP {:?} only (SGLang's HiSparse needs one KV head a rank), not {}",
                    model.name, model.attention_tp, self.tp
                ),
            ));
        }
        let host: u128 =
            self.dram_for_kv as u128 + self.cxl.iter().map(|c| c.bytes as u128).sum::<u128>();
        if host > MAX_PLAN_BYTES as u128 || self.hbm_for_kv > MAX_PLAN_BYTES {
            return Err(invalid(
                "memory",
                format!(
                    "the node's host memory for KV adds up to {host} B (DRAM and CXL) and its HBM for KV to {} B; a \
                     plan counts at most {MAX_PLAN_BYTES} B (8 EiB)",
                    self.hbm_for_kv
                ),
            ));
        }
        if !(self.miss_rate.is_finite() && (0.0..=1.0).contains(&self.miss_rate)) {
            return Err(invalid(
                "miss_rate",
                format!("{} is not in 0..=1", self.miss_rate),
            ));
        }
        Ok(())
    }
}

/// The share of the top-k that missed the hot buffer per layer and decode
/// step in the one published measurement there is (GLM-5.1 under SGLang's
/// HiSparse, as its authors report it), against the hot buffer's size in
/// multiples of the top-k: 30 % at 1×, 13.4 % at 2×, 6.7 % at 4×.
pub const PUBLISHED_MISS_RATES: [(f64, f64); 3] = [(1.0, 0.30), (2.0, 0.134), (4.0, 0.067)];

/// Where [`PUBLISHED_MISS_RATES`] come from, as `kvtier plan` cites it.
pub const PUBLISHED_MISS_RATES_SOURCE: &str = "HiSparse's published GLM-5.1 misses (30 % of top-k at a hot buffer \
     of 1× top-k, 13.4 % at 2×, 6.7 % at 4×)";

/// A miss rate read off [`PUBLISHED_MISS_RATES`] for one hot buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PublishedMissRate {
    /// The share of the top-k missed per layer and step.
    pub rate: f64,
    /// The hot buffer in multiples of the top-k.
    pub ratio: f64,
    pub how: MissRateFrom,
}

/// How a [`PublishedMissRate`] was read off the published points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissRateFrom {
    /// The hot buffer is one of the published sizes.
    Published,
    /// Between two published sizes: linear in the logarithms of both
    /// (the published rate about halves per doubling of the buffer).
    Interpolated,
    /// Larger than the largest published size: its rate, which a larger
    /// buffer can only lower (so an over-estimate of the misses).
    Largest,
}

impl PublishedMissRate {
    /// The rate for a hot buffer of `hot_slots` slots and a top-k of `top_k`
    /// entries (`top_k` ≤ `hot_slots`, as HiSparse requires).
    pub fn for_buffer(hot_slots: u32, top_k: u32) -> Result<Self> {
        if top_k == 0 || hot_slots < top_k {
            return Err(invalid(
                "hot_slots",
                format!(
                    "a hot buffer of {hot_slots} slots cannot hold a top-k of {top_k} (and top-k must be positive)"
                ),
            ));
        }
        let ratio = hot_slots as f64 / top_k as f64;
        let p = PUBLISHED_MISS_RATES;
        if let Some(&(_, rate)) = p.iter().find(|(r, _)| (r - ratio).abs() < 1e-9) {
            return Ok(PublishedMissRate {
                rate,
                ratio,
                how: MissRateFrom::Published,
            });
        }
        let last = p[p.len() - 1];
        if ratio > last.0 {
            return Ok(PublishedMissRate {
                rate: last.1,
                ratio,
                how: MissRateFrom::Largest,
            });
        }
        let w = p
            .windows(2)
            .find(|w| ratio > w[0].0 && ratio < w[1].0)
            .expect("1 <= ratio <= the largest published size");
        let ((x0, y0), (x1, y1)) = (w[0], w[1]);
        let t = (ratio.ln() - x0.ln()) / (x1.ln() - x0.ln());
        Ok(PublishedMissRate {
            rate: (y0.ln() + t * (y1.ln() - y0.ln())).exp(),
            ratio,
            how: MissRateFrom::Interpolated,
        })
    }

    /// One line: the rate, for which buffer, and how it was read.
    pub fn describe(&self) -> String {
        let how = match self.how {
            MissRateFrom::Published => "the published figure".to_string(),
            MissRateFrom::Interpolated => "between the published figures, log-linear".to_string(),
            MissRateFrom::Largest => format!(
                "the largest published buffer's figure ({}× top-k): a larger buffer misses less",
                PUBLISHED_MISS_RATES[PUBLISHED_MISS_RATES.len() - 1].0
            ),
        };
        format!(
            "{:.1} % of the top-k missing per layer and step at a hot buffer of {:.2}× top-k: {how}; source: {}",
            self.rate * 100.0,
            self.ratio,
            PUBLISHED_MISS_RATES_SOURCE
        )
    }
}

/// How many requests `d` holds of `model`, per set of host tiers.
pub fn plan(model: &ModelSpec, d: &Deployment) -> Result<Plan> {
    model.check()?;
    d.check(model)?;
    let total: f64 = d.contexts.iter().map(|c| c.1).sum();
    let avg = |f: &dyn Fn(u64) -> f64| {
        d.contexts
            .iter()
            .map(|&(t, w)| f(t) * w / total)
            .sum::<f64>()
    };
    let host = avg(&|t| model.host_bytes(t) as f64);
    let hbm = avg(&|t| model.hbm_bytes(t) as f64);
    let miss = avg(&|t| model.miss_bytes_per_step(t, d.miss_rate));
    let window_s = d.step_ms / 1e3 * d.link_budget;
    let fit = |budget: f64, per: f64| (per > 0.0).then(|| (budget / per).floor().max(0.0) as u64);
    let groups = (d.gpus / d.tp) as u64;
    let instances = (d.gpus / d.instance_gpus()) as u64;
    let (table_hbm_per_gpu, table_host_bytes) = match d.tables {
        TablePlacement::Hbm => (model.table_bytes.div_ceil(d.instance_gpus() as u64), 0),
        // saturating: more than any host holds is "does not fit"
        TablePlacement::HostPerGroup => (0, instances.saturating_mul(model.table_bytes)),
        TablePlacement::HostShared => (0, model.table_bytes),
    };
    let mut tiers = vec![("DRAM only".to_string(), d.dram_for_kv, Vec::new())];
    if !d.cxl.is_empty() {
        let bytes = d.dram_for_kv + d.cxl.iter().map(|c| c.bytes).sum::<u64>();
        tiers.push(("DRAM + CXL".to_string(), bytes, d.cxl.clone()));
    }
    let capacities = tiers
        .into_iter()
        .map(|(name, host_bytes, cxl)| {
            let host_left = host_bytes.saturating_sub(table_host_bytes);
            let host_limit = if table_host_bytes > host_bytes {
                Some(0) // the tables alone do not fit
            } else {
                fit(host_left as f64, d.gpus as f64 * host)
            };
            let mut per_gpu = vec![
                (
                    Limit::Hbm,
                    fit(d.hbm_for_kv.saturating_sub(table_hbm_per_gpu) as f64, hbm),
                ),
                (Limit::HostMemory, host_limit),
                (Limit::Link, fit(d.link_gbps * 1e9 * window_s, miss)),
            ];
            let cxl_bytes: u64 = cxl.iter().map(|c| c.bytes).sum();
            if !cxl.is_empty() && cxl.iter().all(|c| c.gbps.is_some()) && host_bytes > 0 {
                let gbps: f64 = cxl.iter().filter_map(|c| c.gbps).sum();
                let share = cxl_bytes as f64 / host_bytes as f64;
                per_gpu.push((
                    Limit::CxlBandwidth,
                    fit(gbps * 1e9 * window_s, d.gpus as f64 * miss * share),
                ));
            }
            let (limited_by, per) = per_gpu
                .iter()
                .filter_map(|&(l, n)| n.map(|n| (l, n)))
                .min_by_key(|&(_, n)| n)
                .expect("HBM and host memory always limit");
            let link_bytes = per as f64 * miss;
            Capacity {
                tiers: name,
                host_bytes,
                per_gpu,
                max_requests: per.saturating_mul(groups),
                limited_by,
                link_bytes_per_step: link_bytes,
                link_share: link_bytes / (d.link_gbps * 1e9) / (d.step_ms / 1e3),
            }
        })
        .collect();
    Ok(Plan {
        model: model.clone(),
        host_bytes_per_token: model.host_bytes_per_token(),
        hbm_bytes_per_token: model.hbm_bytes_per_token(),
        host_bytes_per_request: host,
        hbm_bytes_per_request: hbm,
        capacities,
        table_hbm_per_gpu,
        table_host_bytes,
    })
}

/// Prices for [`cost`], in any one currency; memory priced for the KV it
/// holds (the rest of a node's cost in the GPU's price).
#[derive(Clone, Debug, PartialEq)]
pub struct Prices {
    /// One GPU for an hour, with its share of the node.
    pub gpu_hour: f64,
    /// A GiB of DRAM, and of CXL memory, for an hour.
    pub dram_gib_hour: f64,
    pub cxl_gib_hour: f64,
    /// An assumption for the recompute comparison: prefill tokens a second
    /// per GPU.
    pub prefill_tokens_per_s: Option<f64>,
}

/// What a million decode tokens cost with one set of host tiers.
#[derive(Clone, Debug, PartialEq)]
pub struct TierCost {
    pub tiers: String,
    pub node_per_hour: f64,
    pub tokens_per_hour: f64,
    /// None where the node holds no request.
    pub per_million_tokens: Option<f64>,
}

/// Keeping a context on a host tier against recomputing it.
#[derive(Clone, Debug, PartialEq)]
pub struct Recompute {
    /// GPU cost of re-prefilling a million context tokens.
    pub per_million_context_tokens: f64,
    /// Cost of keeping a million context tokens' KV for an hour (every
    /// copy: `tp` of them), and the hours of reuse below which keeping is
    /// cheaper: DRAM, then CXL (None without CXL devices).
    pub keep_per_million_tokens_hour: (f64, Option<f64>),
    pub break_even_hours: (Option<f64>, Option<f64>),
}

/// The cost side of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Cost {
    pub per_tiers: Vec<TierCost>,
    pub recompute: Option<Recompute>,
}

/// The cost per million decode tokens of each of `p`'s tier sets, and (with
/// a prefill rate) keeping a context against recomputing it; formulas in the
/// module's documentation.
pub fn cost(p: &Plan, d: &Deployment, prices: &Prices) -> Result<Cost> {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    if !(ok(prices.gpu_hour) && ok(prices.dram_gib_hour) && ok(prices.cxl_gib_hour)) {
        return Err(invalid("prices", "prices must be finite and not negative"));
    }
    if prices
        .prefill_tokens_per_s
        .is_some_and(|r| !(r.is_finite() && r > 0.0))
    {
        return Err(invalid("prefill", "the prefill rate must be positive"));
    }
    const GIB: f64 = (1u64 << 30) as f64;
    let cxl_bytes: u64 = d.cxl.iter().map(|c| c.bytes).sum();
    let per_tiers = p
        .capacities
        .iter()
        .map(|c| {
            let cxl = c.host_bytes.saturating_sub(d.dram_for_kv);
            let node_per_hour = d.gpus as f64 * prices.gpu_hour
                + d.dram_for_kv as f64 / GIB * prices.dram_gib_hour
                + cxl.min(cxl_bytes) as f64 / GIB * prices.cxl_gib_hour;
            let tokens_per_hour = c.max_requests as f64 * 3.6e6 / d.step_ms;
            TierCost {
                tiers: c.tiers.clone(),
                node_per_hour,
                tokens_per_hour,
                per_million_tokens: (tokens_per_hour > 0.0)
                    .then(|| node_per_hour * 1e6 / tokens_per_hour),
            }
        })
        .collect();
    let recompute = prices.prefill_tokens_per_s.map(|rate| {
        let per_million_context_tokens = prices.gpu_hour / 3600.0 / rate * 1e6;
        // each of a request's `tp` GPUs keeps its own copy on the host
        let keep = |gib_hour: f64| d.tp as f64 * p.host_bytes_per_token * 1e6 / GIB * gib_hour;
        let dram = keep(prices.dram_gib_hour);
        let cxl = (!d.cxl.is_empty()).then(|| keep(prices.cxl_gib_hour));
        let hours = |k: f64| (k > 0.0).then(|| per_million_context_tokens / k);
        Recompute {
            per_million_context_tokens,
            keep_per_million_tokens_hour: (dram, cxl),
            break_even_hours: (hours(dram), cxl.and_then(hours)),
        }
    });
    Ok(Cost {
        per_tiers,
        recompute,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published points exactly; between them log-linear (3× top-k:
    /// 13.4 % × 0.5^log2(1.5)); past 4× the 4× figure; no rate for a buffer
    /// smaller than the top-k.
    #[test]
    fn the_published_miss_rate_for_a_buffer() {
        let at = |hot, k| PublishedMissRate::for_buffer(hot, k).unwrap();
        for (hot, want) in [(2048, 0.30), (4096, 0.134), (8192, 0.067)] {
            let r = at(hot, 2048);
            assert_eq!((r.rate, r.how), (want, MissRateFrom::Published));
        }
        let three = at(6144, 2048);
        assert_eq!(three.how, MissRateFrom::Interpolated);
        let want = 0.134 * 0.5f64.powf(1.5f64.log2());
        assert!((three.rate - want).abs() < 1e-12, "{three:?}");
        assert!(three.rate < 0.134 && three.rate > 0.067);
        let v4 = at(4096, 512);
        assert_eq!(
            (v4.rate, v4.ratio, v4.how),
            (0.067, 8.0, MissRateFrom::Largest)
        );
        assert!(
            v4.describe()
                .contains("the largest published buffer's figure")
        );
        assert!(PublishedMissRate::for_buffer(1024, 2048).is_err());
        assert!(PublishedMissRate::for_buffer(1024, 0).is_err());
    }

    fn v32() -> ModelSpec {
        ModelSpec::preset("deepseek-v3.2").unwrap()
    }

    fn node(contexts: Vec<(u64, f64)>) -> Deployment {
        Deployment {
            contexts,
            gpus: 8,
            tp: 1,
            hbm_for_kv: 40 << 30,
            dram_for_kv: 1 << 40,
            cxl: vec![],
            link_gbps: 55.0,
            miss_rate: 0.02,
            step_ms: 50.0,
            link_budget: 0.2,
            tables: TablePlacement::HostShared,
            instance_gpus: None,
        }
    }

    /// SGLang's fp8 DSA layout of a config's latent: fp8 nope + one 4 B
    /// scale per 128 + bf16 rope; the index key fp8 + one 4 B scale per 128.
    fn assert_dsa_layout(m: &ModelSpec, kv_lora_rank: u32, rope: u32, index_head_dim: u32) {
        assert_eq!(
            m.entry_bytes,
            kv_lora_rank + kv_lora_rank / 128 * 4 + rope * 2
        );
        assert_eq!(
            m.indexer_entry_bytes,
            index_head_dim + index_head_dim / 128 * 4
        );
    }

    #[test]
    fn the_preset_is_the_published_config_in_sglangs_layout() {
        // DeepSeek's config_671B_v3.2.json: n_layers 61, kv_lora_rank 512,
        // qk_rope_head_dim 64, index_head_dim 128, index_topk 2048
        let (layers, kv_lora_rank, rope, index_head_dim, index_topk) = (61, 512, 64, 128, 2048);
        let m = v32();
        assert_eq!(m.offloaded_layers, layers);
        assert_dsa_layout(&m, kv_lora_rank, rope, index_head_dim);
        assert_eq!(
            (m.indexer_layers, m.top_k, m.hot_slots),
            (layers, index_topk, 2 * 2048)
        );
        assert_eq!(m.max_context, 4096 * 40);
        let bf16 = ModelSpec::preset("deepseek-v3.2-bf16").unwrap();
        assert_eq!(bf16.entry_bytes, (kv_lora_rank + rope) * 2);
        assert!(ModelSpec::preset("deepseek-v4").is_err());
    }

    #[test]
    fn the_glm_5_preset_is_its_published_config_in_sglangs_dsa_layout() {
        // zai-org/GLM-5 config.json: num_hidden_layers 78, kv_lora_rank 512,
        // qk_rope_head_dim 64, index_head_dim 128, index_topk 2048,
        // max_position_embeddings 202752
        let (layers, kv_lora_rank, rope, index_head_dim, index_topk, max_pos) =
            (78, 512, 64, 128, 2048, 202_752);
        let m = ModelSpec::preset("glm-5").unwrap();
        assert_eq!((m.offloaded_layers, m.indexer_layers), (layers, layers));
        assert_dsa_layout(&m, kv_lora_rank, rope, index_head_dim);
        assert_eq!((m.top_k, m.hot_slots), (index_topk, 2 * 2048));
        assert_eq!(m.max_context, max_pos);
        assert_eq!(m.host_bytes_per_token(), 78.0 * 656.0); // 51,168 B
        let bf16 = ModelSpec::preset("glm-5-bf16").unwrap();
        assert_eq!(bf16.entry_bytes, (kv_lora_rank + rope) * 2);
    }

    #[test]
    fn bytes_per_token_and_request_by_hand() {
        let m = v32();
        assert_eq!(m.host_bytes_per_token(), 40_016.0); // 61 × 656
        assert_eq!(m.hbm_bytes_per_token(), 8_052.0); // 61 × 132
        let t = 131_072;
        assert_eq!(m.host_bytes(t), 5_244_977_152); // 40016 × 131072: "~5.2 GB per 128K request"
        // indexer 8052 × 131072 + HOT (4096 + 64) × 40016
        assert_eq!(m.hbm_bytes(t), 1_055_391_744 + 166_466_560);
        // a short request holds its own tokens, a page at a time
        assert_eq!(m.hot_slots_for(100), 128);
        assert_eq!(m.hbm_bytes(100), 8_052 * 100 + 40_016 * 128);
        assert_eq!(
            m.miss_bytes_per_step(1000, 0.5),
            0.0,
            "fits its HOT buffer: no misses"
        );
        // 61 layers × 2% of 2048 × 656 B
        assert!((m.miss_bytes_per_step(t, 0.02) - 61.0 * 40.96 * 656.0).abs() < 1e-6);
    }

    #[test]
    fn the_binding_resource_by_hand() {
        let m = v32();
        let t = 131_072;
        // HBM: 40 GiB / 1,221,858,304 B = 35.15 -> 35 per GPU
        // host: 1 TiB / (8 × 5,244,977,152) = 26.2 -> 26 per GPU: DRAM binds
        let mut d = node(vec![(t, 1.0)]);
        let p = plan(&m, &d).unwrap();
        let dram = &p.capacities[0];
        assert_eq!(dram.per_gpu[0], (Limit::Hbm, Some(35)));
        assert_eq!(dram.per_gpu[1], (Limit::HostMemory, Some(26)));
        // link: 55e9 × 0.01 s / 1,639,055.36 B = 335.6 -> 335
        assert_eq!(dram.per_gpu[2], (Limit::Link, Some(335)));
        assert_eq!(
            (dram.max_requests, dram.limited_by),
            (26 * 8, Limit::HostMemory)
        );
        // a CXL device of 512 GiB: 1.5 TiB / (8 × 5.24e9) = 39.3: HBM binds at 35
        d.cxl = vec![HostTier {
            name: "cxl0".into(),
            bytes: 512 << 30,
            gbps: Some(30.0),
        }];
        let p = plan(&m, &d).unwrap();
        let both = &p.capacities[1];
        assert_eq!(both.per_gpu[1], (Limit::HostMemory, Some(39)));
        // CXL serves 1/3 of the misses: 30e9 × 0.01 / (8 × 1,639,055.36 / 3) = 68.6 -> 68
        assert_eq!(both.per_gpu[3], (Limit::CxlBandwidth, Some(68)));
        assert_eq!((both.max_requests, both.limited_by), (35 * 8, Limit::Hbm));
        // tensor parallelism: a request on 2 GPUs, each with a copy
        d.tp = 2;
        assert_eq!(plan(&m, &d).unwrap().capacities[1].max_requests, 35 * 4);
        // a high miss rate: the link binds
        d.miss_rate = 0.5;
        let p = plan(&m, &d).unwrap();
        // DRAM only: 55e9 × 0.01 / (61 × 1024 × 656) = 13.4 -> 13, under HBM's 35 and host's 26
        assert_eq!(p.capacities[0].limited_by, Limit::Link);
        assert_eq!(p.capacities[0].per_gpu[2], (Limit::Link, Some(13)));
        // with the CXL device serving a third of the misses at 30 GB/s:
        // 30e9 × 0.01 / (8 × 40,976,384 / 3) = 2.7 -> 2
        assert_eq!(p.capacities[1].limited_by, Limit::CxlBandwidth);
        assert_eq!(p.capacities[1].max_requests, 2 * 4);
    }

    #[test]
    fn a_mix_averages_per_request_and_short_requests_miss_nothing() {
        let m = v32();
        let d = node(vec![(4_000, 3.0), (131_072, 1.0)]);
        let p = plan(&m, &d).unwrap();
        let host = (3.0 * m.host_bytes(4_000) as f64 + m.host_bytes(131_072) as f64) / 4.0;
        assert!((p.host_bytes_per_request - host).abs() < 1.0);
        let link = p.capacities[0].per_gpu[2].1.unwrap();
        // only a quarter of the requests miss
        assert_eq!(
            link,
            (55e9 * 0.01 / (m.miss_bytes_per_step(131_072, 0.02) / 4.0)).floor() as u64
        );
    }

    #[test]
    fn bad_deployments_are_refused() {
        let m = v32();
        let mut d = node(vec![(200_000, 1.0)]);
        assert!(
            plan(&m, &d)
                .unwrap_err()
                .to_string()
                .contains("past deepseek-v3.2's 163840")
        );
        d.contexts = vec![];
        assert!(plan(&m, &d).is_err());
        d = node(vec![(1000, 1.0)]);
        d.tp = 3;
        assert!(plan(&m, &d).is_err());
        d.tp = 1;
        d.miss_rate = 1.5;
        assert!(plan(&m, &d).is_err());
    }

    /// Byte counts past 64 bits wrapped: 2^31 layers of 2 GiB entries
    /// planned 343,597,383,680 requests on a 512 GiB node ("host 0 B"), and
    /// adding 2 TiB of CXL to 16777215 TiB of DRAM lowered the node from
    /// 280 requests to 208. Both are refused now, saying why.
    #[test]
    fn byte_counts_past_64_bits_are_refused_not_wrapped() {
        let mut m = v32();
        m.name = "huge".into();
        m.offloaded_layers = 1 << 31;
        m.entry_bytes = 1 << 31;
        m.indexer_layers = 0;
        m.max_context = 1024;
        let d = node(vec![(1024, 1.0)]);
        let e = plan(&m, &d).unwrap_err().to_string();
        assert!(e.contains("more than any machine holds"), "{e}");
        let mut long = v32();
        long.max_context = u64::MAX;
        let e = plan(&long, &node(vec![(1024, 1.0)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_context"), "{e}");
        // the same model one token long still counts right
        m.offloaded_layers = 1 << 20;
        assert_eq!(m.host_bytes(1024), (1u64 << 51) * 1024);
        assert_eq!(m.host_bytes(u64::MAX), u64::MAX, "saturated, never wrapped");
        let mut d = node(vec![(131_072, 1.0)]);
        d.dram_for_kv = (16_777_215u64) << 40;
        d.cxl = vec![HostTier {
            name: "cxl".into(),
            bytes: 2 << 40,
            gbps: None,
        }];
        let e = plan(&v32(), &d).unwrap_err().to_string();
        assert!(e.contains("8 EiB"), "{e}");
        // near the limit, more memory never means fewer requests
        d.dram_for_kv = 1 << 62;
        let p = plan(&v32(), &d).unwrap();
        assert!(p.capacities[1].max_requests >= p.capacities[0].max_requests);
    }

    #[test]
    fn cost_per_million_tokens_and_the_recompute_break_even_are_the_formulas() {
        let mut d = node(vec![(131_072, 1.0)]);
        d.cxl = vec![HostTier {
            name: "cxl0".into(),
            bytes: 1 << 40,
            gbps: None,
        }];
        let p = plan(&v32(), &d).unwrap();
        let prices = Prices {
            gpu_hour: 2.0,
            dram_gib_hour: 0.001,
            cxl_gib_hour: 0.0005,
            prefill_tokens_per_s: Some(10_000.0),
        };
        let c = cost(&p, &d, &prices).unwrap();
        // DRAM only: 8 GPUs x 2 + 1024 GiB x 0.001 an hour
        let dram = &c.per_tiers[0];
        assert!((dram.node_per_hour - (16.0 + 1.024)).abs() < 1e-9);
        let n = p.capacities[0].max_requests as f64;
        // 50 ms steps: 72,000 tokens an hour per request
        assert!((dram.tokens_per_hour - n * 72_000.0).abs() < 1e-6);
        let want = 17.024 * 1e6 / (n * 72_000.0);
        assert!((dram.per_million_tokens.unwrap() - want).abs() < 1e-9);
        // with CXL: its 1024 GiB priced at its own rate
        assert!((c.per_tiers[1].node_per_hour - (17.024 + 0.512)).abs() < 1e-9);
        // recomputing a million tokens: 100 GPU-seconds at 2 an hour
        let r = c.recompute.unwrap();
        assert!((r.per_million_context_tokens - 2.0 / 36.0).abs() < 1e-12);
        // keeping them: 40,016 B per token (656 B x 61 layers)
        let keep_dram = 40_016.0 * 1e6 / (1u64 << 30) as f64 * 0.001;
        assert!((r.keep_per_million_tokens_hour.0 - keep_dram).abs() < 1e-12);
        assert!((r.keep_per_million_tokens_hour.1.unwrap() - keep_dram / 2.0).abs() < 1e-12);
        let hours = (2.0 / 36.0) / keep_dram;
        assert!((r.break_even_hours.0.unwrap() - hours).abs() < 1e-9);
        assert!((r.break_even_hours.1.unwrap() - 2.0 * hours).abs() < 1e-9);
        // free memory: keeping always wins (no break-even)
        let free = Prices {
            dram_gib_hour: 0.0,
            cxl_gib_hour: 0.0,
            ..prices.clone()
        };
        assert_eq!(
            cost(&p, &d, &free)
                .unwrap()
                .recompute
                .unwrap()
                .break_even_hours,
            (None, None)
        );
        for bad in [-1.0, f64::NAN] {
            let p2 = Prices {
                gpu_hour: bad,
                ..prices.clone()
            };
            assert!(cost(&p, &d, &p2).is_err());
        }
        let p3 = Prices {
            prefill_tokens_per_s: Some(0.0),
            ..prices.clone()
        };
        assert!(cost(&p, &d, &p3).is_err());
        // attention TP 8: eight host copies of each request, eight times the cost
        let mut d8 = d.clone();
        d8.tp = 8;
        let r8 = cost(&plan(&v32(), &d8).unwrap(), &d8, &prices)
            .unwrap()
            .recompute
            .unwrap();
        assert!((r8.keep_per_million_tokens_hour.0 - 8.0 * keep_dram).abs() < 1e-9);
        // no CXL: no CXL figures
        let mut no_cxl = d.clone();
        no_cxl.cxl.clear();
        let r = cost(&plan(&v32(), &no_cxl).unwrap(), &no_cxl, &prices)
            .unwrap()
            .recompute
            .unwrap();
        assert_eq!(
            (r.keep_per_million_tokens_hour.1, r.break_even_hours.1),
            (None, None)
        );
    }

    #[test]
    fn the_deepseek_v4_presets_are_their_configs_in_sglangs_hisparse_layout() {
        // V4-Flash's config.json: 43 layers, compress_ratios [0,0] + [4,128] x 20
        // + [4] (the MTP slot's 0 left out): 21 C4, 20 C128, 2 window-only;
        // index_topk 512
        let m = ModelSpec::preset("deepseek-v4-flash").unwrap();
        assert_eq!(
            (m.offloaded_layers, m.indexer_layers, m.top_k),
            (21, 21, 512)
        );
        // SGLang 0.5.23: 584 B entries in 64-entry pages padded to 576 B
        // multiples (37,440 B a page: 585 B an entry), one per 4 tokens
        assert_eq!((64 * 584u32).next_multiple_of(576) / 64, m.entry_bytes);
        assert_eq!(m.tokens_per_entry, 4);
        // C128: 2-entry pages padded to 1728 B, one entry per 128 tokens
        assert_eq!(
            m.resident_layers,
            vec![(20, (2 * 584u32).next_multiple_of(576) / 2, 128)]
        );
        assert_eq!(m.host_bytes_per_token(), 21.0 * 585.0 / 4.0);
        assert_eq!(
            m.hbm_bytes_per_token(),
            21.0 * 132.0 / 4.0 + 20.0 * 864.0 / 128.0
        );
        // a 128K-token request, by hand: 32768 C4 entries
        let host = 21 * 585 * 32_768u64;
        let indexer = 21 * 132 * 32_768u64;
        let hot = 21 * 585 * (4096 + 64u64);
        let c128 = 20 * 864 * 1024u64;
        let fixed = 768 * 585 * 43 + 768 * 320 * 21 + (512 << 10) * 20u64;
        assert_eq!(m.host_bytes(131_072), host);
        assert_eq!(m.hbm_bytes(131_072), indexer + hot + c128 + fixed);
        assert_eq!(m.max_context, 1_048_576);
        let pro = ModelSpec::preset("deepseek-v4-pro").unwrap();
        assert_eq!((pro.offloaded_layers, pro.top_k), (30, 1024));
        assert_eq!(pro.resident_layers, vec![(31, 864, 128)]);
        assert_eq!(
            pro.hbm_bytes_per_request,
            768 * 585 * 61 + 768 * 320 * 30 + (512 << 10) * 31
        );
    }

    #[test]
    fn deepseek_v4_1_keeps_its_kv_in_hbm_and_its_engram_tables_where_placed() {
        // V4.1-Flash's config: 40 layers; compress_ratios [0,0] + [2]x18 +
        // [1]x20; kv_source_layer_ids [2, 8, 14, 20] (the only layers with
        // their own compressed KV: three at ratio 2, one at ratio 1)
        let ratios: Vec<u32> = [0, 0].into_iter().chain([2; 18]).chain([1; 20]).collect();
        let sources = [2usize, 8, 14, 20];
        let mut by_ratio = std::collections::BTreeMap::<u32, u32>::new();
        for &l in &sources {
            *by_ratio.entry(ratios[l]).or_default() += 1;
        }
        let m = ModelSpec::preset("deepseek-v4.1-flash").unwrap();
        assert!(!m.offloads());
        // 585 B a KV entry (Hopper's layout) + a 68 B fp4 index key
        let entry = 585 + 68;
        assert_eq!(
            m.resident_layers,
            vec![(by_ratio[&2], entry, 2), (by_ratio[&1], entry, 1)]
        );
        assert_eq!(m.host_bytes_per_token(), 0.0);
        assert_eq!(m.hbm_bytes_per_token(), 1632.5);
        // a 128K-token request by hand: 3 × 65536 + 131072 entries, the
        // window (768 tokens × 40 layers × 585 B) and 3 × 2 × 4 KiB of state
        assert_eq!(
            m.hbm_bytes(131_072),
            653 * (3 * 65_536 + 131_072) + 768 * 40 * 585 + 24_576
        );
        assert_eq!(m.host_bytes(131_072), 0);
        // the Engram tables: 384006168 + 384016682 rows of 256 + 256/32 B
        assert_eq!(
            m.table_bytes,
            (384_006_168 + 384_016_682) * (256 + 256 / 32)
        );
        assert_eq!(m.table_bytes, 202_758_032_400);

        // 8 GPUs in TP groups of 8 (one group), 100 GiB of HBM for KV a GPU
        let d = |tables| Deployment {
            tp: 8,
            hbm_for_kv: 100 << 30,
            dram_for_kv: 512 << 30,
            tables,
            ..node(vec![(131_072, 1.0)])
        };
        let per_req = m.hbm_bytes(131_072) as f64;
        let requests = |tables| {
            let p = plan(&m, &d(tables)).unwrap();
            assert_eq!(p.capacities.len(), 1);
            let c = &p.capacities[0];
            (
                c.max_requests,
                c.limited_by,
                p.table_hbm_per_gpu,
                p.table_host_bytes,
            )
        };
        // in HBM: each GPU gives up an eighth of the tables
        let hbm_left = (100u64 << 30) - 202_758_032_400u64.div_ceil(8);
        assert_eq!(
            requests(TablePlacement::Hbm),
            (
                (hbm_left as f64 / per_req) as u64,
                Limit::Hbm,
                202_758_032_400u64.div_ceil(8),
                0
            )
        );
        // on the host: HBM whole, and the tables fit 512 GiB once
        let whole = ((100u64 << 30) as f64 / per_req) as u64;
        assert_eq!(
            requests(TablePlacement::HostShared),
            (whole, Limit::Hbm, 0, 202_758_032_400)
        );
        assert_eq!(
            requests(TablePlacement::HostPerGroup),
            (whole, Limit::Hbm, 0, 202_758_032_400)
        );
        // eight instances of TP 1: a copy each is 1.5 TiB, past 512 GiB
        let eight = Deployment {
            tp: 1,
            ..d(TablePlacement::HostPerGroup)
        };
        let p = plan(&m, &eight).unwrap();
        assert_eq!(
            (p.capacities[0].max_requests, p.capacities[0].limited_by),
            (0, Limit::HostMemory)
        );
        let shared = plan(
            &m,
            &Deployment {
                tables: TablePlacement::HostShared,
                ..eight.clone()
            },
        )
        .unwrap();
        assert_eq!(shared.capacities[0].max_requests, 8 * whole);
        assert_eq!(shared.capacities[0].link_bytes_per_step, 0.0);
        // DP attention: attention TP 1, one 8-GPU instance (engine TP 8):
        // SGLang shards the tables over all 8, one copy in all
        let dp = Deployment {
            tp: 1,
            instance_gpus: Some(8),
            ..d(TablePlacement::Hbm)
        };
        let p = plan(&m, &dp).unwrap();
        assert_eq!(p.table_hbm_per_gpu, 202_758_032_400u64.div_ceil(8));
        let p = plan(
            &m,
            &Deployment {
                tables: TablePlacement::HostPerGroup,
                ..dp.clone()
            },
        )
        .unwrap();
        assert_eq!(p.table_host_bytes, 202_758_032_400);
        for bad in [3, 16, 0] {
            let e = plan(
                &m,
                &Deployment {
                    instance_gpus: Some(bad),
                    tp: 2,
                    ..dp.clone()
                },
            )
            .unwrap_err();
            assert!(e.to_string().contains("instance"), "{e}");
        }
        // a model file's huge table: saturates to "does not fit", never wraps
        let huge = ModelSpec {
            table_bytes: 1 << 63,
            ..m.clone()
        };
        let p = plan(&huge, &eight).unwrap();
        assert_eq!(p.table_host_bytes, u64::MAX);
        assert_eq!(p.capacities[0].max_requests, 0);
    }

    #[test]
    fn minimax_m3_is_a_ranks_head_of_its_sparse_layers_at_tp_4_or_8() {
        // MiniMax-M3's config.json: 60 layers, sparse_attention_freq 0 for
        // layers 0-2 and 1 for 3-59; 4 KV heads of head_dim 128; index
        // head_dim 128 (K only); topk_blocks 16 of 128 tokens
        let freq: Vec<u32> = [0; 3].into_iter().chain([1; 57]).collect();
        let sparse = freq.iter().filter(|&&f| f == 1).count() as u32;
        let (head_dim, index_head_dim) = (128u32, 128u32);
        let m = ModelSpec::preset("minimax-m3").unwrap();
        // one head a rank, K and V, bf16
        let entry = 2 * head_dim * 2;
        assert_eq!(
            (m.offloaded_layers, m.entry_bytes, m.indexer_layers),
            (sparse, entry, sparse)
        );
        assert_eq!(m.indexer_entry_bytes, index_head_dim * 2);
        assert_eq!(m.resident_layers, vec![(60 - sparse, entry, 1)]);
        assert_eq!(
            (m.top_k, m.hot_slots, m.page_entries),
            (16 * 128, 4096, 128)
        );
        assert_eq!(m.host_bytes_per_token(), 29_184.0);
        let fp8 = ModelSpec::preset("minimax-m3-fp8").unwrap();
        assert_eq!((fp8.entry_bytes, fp8.indexer_entry_bytes), (256, 128));
        // a 128K-token request by hand, per rank
        let t = 131_072u64;
        assert_eq!(m.host_bytes(t), 57 * 512 * t);
        assert_eq!(
            m.hbm_bytes(t),
            57 * 256 * t + 57 * 512 * (4096 + 128) + 3 * 512 * t + 8 * ((1 << 20) + 128)
        );
        // the link: 57 layers × 2% of 2048 × 512 B a decode step
        assert_eq!(m.miss_bytes_per_step(t, 0.02), 57.0 * 0.02 * 2048.0 * 512.0);
        // TP 1 or 2 is refused: SGLang's coordinator needs one head a rank
        for tp in [1, 2] {
            let e = plan(
                &m,
                &Deployment {
                    tp,
                    ..node(vec![(t, 1.0)])
                },
            )
            .unwrap_err();
            assert!(e.to_string().contains("one KV head a rank"), "{e}");
        }
        let p = plan(
            &m,
            &Deployment {
                tp: 4,
                ..node(vec![(t, 1.0)])
            },
        )
        .unwrap();
        let c = &p.capacities[0];
        let hbm = ((40u64 << 30) as f64 / m.hbm_bytes(t) as f64) as u64;
        let host = ((1u64 << 40) as f64 / (8.0 * m.host_bytes(t) as f64)) as u64;
        assert_eq!(c.per_gpu[0], (Limit::Hbm, Some(hbm)));
        assert_eq!(c.per_gpu[1], (Limit::HostMemory, Some(host)));
        assert_eq!(c.max_requests, hbm.min(host) * 2);
    }
}
