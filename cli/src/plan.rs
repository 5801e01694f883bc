//! `kvtier plan`: what a deployment holds, per tier, and what binds.

use std::path::PathBuf;

use clap::Args;
use kvtier::plan::{
    Cost, Deployment, HostTier, ModelSpec, Plan, Prices, TablePlacement, cost, plan,
};
use kvtier::pool::{human_size, parse_size};
use serde_json::{Value, json};

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A built-in model: deepseek-v3.2, glm-5 (GLM-5 and 5.1),
    /// deepseek-v4-flash or deepseek-v4-pro (fp8 KV); deepseek-v3.2-bf16 or
    /// glm-5-bf16; deepseek-v4.1-flash (no HiSparse: KV in HBM, Engram
    /// tables); minimax-m3 (bf16 KV) or minimax-m3-fp8, at --tp 4 or 8.
    #[arg(long, default_value = "deepseek-v3.2", conflicts_with = "model_file")]
    model: String,
    /// A model described in JSON instead: offloaded_layers, entry_bytes,
    /// tokens_per_entry, indexer_layers, indexer_entry_bytes, top_k,
    /// hot_slots, page_entries, max_context; optionally resident_layers,
    /// hbm_bytes_per_request, table_bytes and attention_tp (see the README).
    #[arg(long)]
    model_file: Option<PathBuf>,
    /// A context length in tokens (128K = 131072), with its share of the
    /// requests after a colon (128K:0.25); repeat for a mix.
    #[arg(long = "context")]
    contexts: Vec<String>,
    /// GPUs in the node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Attention tensor parallelism: GPUs that each hold a copy of a
    /// request's KV (MLA).
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// HBM per GPU left for KV (HOT buffers and indexer keys) after the
    /// weights and activations, e.g. 40GiB.
    #[arg(long)]
    hbm_for_kv: Option<String>,
    /// The node's DRAM for KV, e.g. 1536GiB.
    #[arg(long)]
    dram_for_kv: Option<String>,
    /// A CXL memory device of the node: SIZE, or SIZE@GBPS with its read
    /// bandwidth in GB/s. Repeat for each.
    #[arg(long)]
    cxl: Vec<String>,
    /// Host-to-GPU bandwidth per GPU, GB/s (55: measured host to device on
    /// an H100 over PCIe 5, see the README).
    #[arg(long, default_value_t = 55.0)]
    link_gbps: f64,
    /// An assumption: the share of each layer's top-k that misses the HOT
    /// buffer per decode step (default: the published GLM-5.1 figure for
    /// the model's hot buffer, 30 % at 1× top-k, 13.4 % at 2×, 6.7 % at 4×;
    /// the output says which it used).
    #[arg(long, conflicts_with = "decode_step")]
    miss_rate: Option<f64>,
    /// Instead of --miss-rate: the miss rate a decode step measured, from
    /// the JSON lines of `kvtier bench --scenario decode-step` (kvtier's
    /// own rows, the batch nearest the plan's); the output then gives the
    /// swap-in time that step measured as a share of --step-ms.
    #[arg(long, value_name = "FILE")]
    decode_step: Option<PathBuf>,
    /// An assumption: a decode step's time, in ms.
    #[arg(long, default_value_t = 50.0)]
    step_ms: f64,
    /// An assumption: the share of a decode step the swap-ins may take.
    #[arg(long, default_value_t = 0.2)]
    link_budget: f64,
    /// A price: one GPU for an hour, with its share of the node (any
    /// currency, the same for every price). Gives the cost per million
    /// decode tokens.
    #[arg(long, value_name = "PRICE")]
    price_gpu_hour: Option<f64>,
    /// A price: one GiB of DRAM for an hour (default 0: in the GPU's price).
    #[arg(long, value_name = "PRICE", requires = "price_gpu_hour")]
    price_dram_gib_hour: Option<f64>,
    /// A price: one GiB of CXL memory for an hour (default 0).
    #[arg(long, value_name = "PRICE", requires = "price_gpu_hour")]
    price_cxl_gib_hour: Option<f64>,
    /// An assumption, with prices: prefill tokens a second per GPU, to
    /// price recomputing a context against keeping its KV on the host.
    #[arg(long, requires = "price_gpu_hour")]
    prefill_tokens_per_s: Option<f64>,
    /// Where a model's static tables (DeepSeek-V4.1's Engram tables) live:
    /// hbm (sharded over each TP group, SGLang's default), host-per-group
    /// (SGLang's host table: a copy per TP group) or host-shared (kvtier's
    /// table store: one copy a node).
    #[arg(long, default_value = "host-shared")]
    tables: String,
    /// GPUs of one server instance, over which SGLang shards the tables
    /// (default: --tp; with DP attention the engine's TP, --tp × DP).
    #[arg(long)]
    instance_gpus: Option<u32>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Instead of a deployment: replay a top-k trace (recorded by the SGLang
    /// shim, or `kvtier trace synth`) through the swap-in's exact policy at
    /// each `--hot` size: hits, misses and the miss rate per layer and in
    /// all.
    #[arg(long, conflicts_with_all = ["contexts", "hbm_for_kv", "dram_for_kv", "cxl", "plot"])]
    trace: Option<PathBuf>,
    /// Hot-buffer sizes (slots per request) to replay the trace at,
    /// comma-separated (default: the recorded size, half and twice it).
    #[arg(long, requires = "trace", value_delimiter = ',')]
    hot: Vec<u32>,
    /// The most memory the trace's replay keeps of request rows' hot-buffer
    /// states (6 B a slot for each row longer than its buffer); a trace that
    /// needs more is replayed a group of layers at a time.
    #[arg(long, requires = "trace", default_value = "256MiB")]
    replay_memory: String,
    /// Draw requests per node against context length, per tier set (PNG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// A TrueType font for the plot's text (default: one under /usr/share/fonts).
    #[arg(long)]
    plot_font: Option<PathBuf>,
}

fn arg_err(arg: &'static str, msg: String) -> kvtier::Error {
    kvtier::Error::InvalidArgument { arg, msg }
}

/// `s` as a finite positive number, else an error naming `arg`, the text
/// `whole` it came from and what it should be.
fn positive(arg: &'static str, whole: &str, s: &str, what: &str) -> kvtier::Result<f64> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| arg_err(arg, format!("{whole:?}: {s:?} is not {what}")))
}

/// `131072`, `128K` (×1024) or `1M` (×1024²) tokens.
fn parse_tokens(s: &str) -> kvtier::Result<u64> {
    let (num, mult) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with('K') => (t.trim_end_matches('K').to_string(), 1u64 << 10),
        t if t.ends_with('M') => (t.trim_end_matches('M').to_string(), 1 << 20),
        t => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            arg_err(
                "--context",
                format!("{s:?} is not a token count such as 131072 or 128K"),
            )
        })
}

fn model(a: &PlanArgs) -> kvtier::Result<ModelSpec> {
    let Some(path) = &a.model_file else {
        return ModelSpec::preset(&a.model).map_err(|e| arg_err("--model", e.to_string()));
    };
    // a regular file, never waited on, at most 1 MiB (a model is a few lines)
    let mut f = kvtier::shared_fs::open_input(path, "--model-file")?;
    let text = kvtier::shared_fs::read_capped(&mut f, 1 << 20)
        .map_err(|source| kvtier::Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?
        .ok_or_else(|| arg_err("--model-file", format!("{} is over 1 MiB", path.display())))?;
    let v: Value = serde_json::from_slice(&text)
        .map_err(|e| arg_err("--model-file", format!("{}: {e}", path.display())))?;
    let field = |k: &str| {
        v.get(k).and_then(Value::as_u64).ok_or_else(|| {
            arg_err(
                "--model-file",
                format!("{}: `{k}` must be a non-negative integer", path.display()),
            )
        })
    };
    let small = |k: &str| {
        field(k).and_then(|n| {
            u32::try_from(n).map_err(|_| {
                arg_err(
                    "--model-file",
                    format!("{}: `{k}` is too large", path.display()),
                )
            })
        })
    };
    Ok(ModelSpec {
        name: v
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("model")
            .to_string(),
        offloaded_layers: small("offloaded_layers")?,
        entry_bytes: small("entry_bytes")?,
        tokens_per_entry: small("tokens_per_entry")?,
        indexer_layers: small("indexer_layers")?,
        indexer_entry_bytes: small("indexer_entry_bytes")?,
        top_k: small("top_k")?,
        hot_slots: small("hot_slots")?,
        page_entries: small("page_entries")?,
        max_context: field("max_context")?,
        resident_layers: match v.get("resident_layers") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .ok_or_else(|| {
                    arg_err(
                        "--model-file",
                        format!(
                            "{}: `resident_layers` must be a list of [layers, entry_bytes, tokens_per_entry]",
                            path.display()
                        ),
                    )
                })?
                .iter()
                .map(|t| {
                    let n: Vec<u32> = t
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                                .collect()
                        })
                        .unwrap_or_default();
                    match n[..] {
                        [l, e, tpe] if t.as_array().is_some_and(|a| a.len() == 3) => Ok((l, e, tpe)),
                        _ => Err(arg_err(
                            "--model-file",
                            format!(
                                "{}: `resident_layers` entry {t} is not [layers, entry_bytes, tokens_per_entry]",
                                path.display()
                            ),
                        )),
                    }
                })
                .collect::<kvtier::Result<Vec<_>>>()?,
        },
        hbm_bytes_per_request: match v.get("hbm_bytes_per_request") {
            None => 0,
            Some(_) => field("hbm_bytes_per_request")?,
        },
        table_bytes: match v.get("table_bytes") {
            None => 0,
            Some(_) => field("table_bytes")?,
        },
        attention_tp: match v.get("attention_tp") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                        .collect::<Option<Vec<u32>>>()
                })
                .ok_or_else(|| {
                    arg_err(
                        "--model-file",
                        format!(
                            "{}: `attention_tp` must be a list of TP sizes",
                            path.display()
                        ),
                    )
                })?,
        },
        source: v
            .get("source")
            .and_then(Value::as_str)
            .unwrap_or("a model file")
            .to_string(),
    })
}

fn deployment(
    a: &PlanArgs,
    contexts: Vec<(u64, f64)>,
    miss_rate: f64,
) -> kvtier::Result<Deployment> {
    let size = |arg: &'static str, s: &str| parse_size(s).map_err(|e| arg_err(arg, e.to_string()));
    let cxl = a
        .cxl
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (bytes, gbps) = match c.split_once('@') {
                Some((b, g)) => (
                    size("--cxl", b)?,
                    Some(positive("--cxl", c, g, "a bandwidth in GB/s")?),
                ),
                None => (size("--cxl", c)?, None),
            };
            Ok(HostTier {
                name: format!("cxl{i}"),
                bytes,
                gbps,
            })
        })
        .collect::<kvtier::Result<Vec<_>>>()?;
    Ok(Deployment {
        contexts,
        gpus: a.gpus,
        tp: a.tp,
        hbm_for_kv: size("--hbm-for-kv", a.hbm_for_kv.as_deref().unwrap_or_default())?,
        dram_for_kv: size(
            "--dram-for-kv",
            a.dram_for_kv.as_deref().unwrap_or_default(),
        )?,
        cxl,
        link_gbps: a.link_gbps,
        miss_rate,
        step_ms: a.step_ms,
        link_budget: a.link_budget,
        tables: a
            .tables
            .parse()
            .map_err(|e: kvtier::Error| arg_err("--tables", e.to_string()))?,
        instance_gpus: a.instance_gpus,
    })
}

fn contexts(a: &PlanArgs) -> kvtier::Result<Vec<(u64, f64)>> {
    a.contexts
        .iter()
        .map(|c| match c.split_once(':') {
            Some((t, w)) => Ok((
                parse_tokens(t)?,
                positive("--context", c, w, "a positive share")?,
            )),
            None => Ok((parse_tokens(c)?, 1.0)),
        })
        .collect()
}

/// What `kvtier plan` needs when a deployment is planned, with a worked
/// example (the README's), instead of clap's bare list.
const NEEDED: &str = "a deployment needs --context (tokens a request: 131072 or 128K, or a mix \
    such as --context 32K:0.75 --context 128K:0.25), --hbm-for-kv (HBM per GPU left for KV after the \
    weights, e.g. 40GiB) and --dram-for-kv (the node's DRAM for KV, e.g. 512GiB); the rest have \
    defaults (8 GPUs, attention TP 1, 55 GB/s a GPU, 2% misses, 50 ms steps: `kvtier plan --help`). \
    For example: kvtier plan --context 128K --hbm-for-kv 40GiB --dram-for-kv 512GiB --cxl 512GiB@30. \
    Or --trace FILE to replay a top-k trace instead";

pub fn run(a: PlanArgs) -> kvtier::Result<()> {
    if let Some(path) = &a.trace {
        let budget =
            parse_size(&a.replay_memory).map_err(|e| arg_err("replay-memory", e.to_string()))?;
        return super::trace::replay_curve(path, &a.hot, budget, a.json);
    }
    let missing: Vec<&str> = [
        ("--context", a.contexts.is_empty()),
        ("--hbm-for-kv", a.hbm_for_kv.is_none()),
        ("--dram-for-kv", a.dram_for_kv.is_none()),
    ]
    .into_iter()
    .filter_map(|(flag, absent)| absent.then_some(flag))
    .collect();
    if !missing.is_empty() {
        return Err(arg_err(
            "plan",
            format!("{} missing: {NEEDED}", missing.join(", ")),
        ));
    }
    let m = model(&a)?;
    let mix = contexts(&a)?;
    let rate = MissRate::choose(&a, &m)?;
    let d = deployment(&a, mix, rate.rate())?;
    if let Some(path) = &a.plot {
        // checked before anything is printed
        super::bench::find_font(a.plot_font.as_deref())?;
        let _ = path;
    }
    let p = plan(&m, &d).map_err(in_the_users_words)?;
    let c = match a.price_gpu_hour {
        Some(gpu_hour) => Some(
            cost(
                &p,
                &d,
                &Prices {
                    gpu_hour,
                    dram_gib_hour: a.price_dram_gib_hour.unwrap_or(0.0),
                    cxl_gib_hour: a.price_cxl_gib_hour.unwrap_or(0.0),
                    prefill_tokens_per_s: a.prefill_tokens_per_s,
                },
            )
            .map_err(in_the_users_words)?,
        ),
        None => None,
    };
    if a.json {
        let mut v = to_json(&p, &d);
        v["assumptions"]["miss_rate_source"] = json!(rate.describe());
        v["miss_rate_spread"] = json!(
            spread(&m, &d)
                .iter()
                .map(
                    |(ratio, r, share, n)| json!({"hot_over_top_k": ratio, "miss_rate": r,
                "link_share": share, "max_requests": n})
                )
                .collect::<Vec<_>>()
        );
        if let MissRate::Measured(s) = &rate {
            v["decode_step"] = s.to_json(d.step_ms);
        }
        if let Some(c) = &c {
            v["cost"] = cost_json(c);
        }
        println!("{v}");
    } else {
        print_table(&p, &d, &rate);
        if let Some(c) = &c {
            print_cost(c);
        }
    }
    if let Some(path) = &a.plot {
        draw(path, a.plot_font.as_deref(), &m, &d)?;
    }
    Ok(())
}

fn in_the_users_words(e: kvtier::Error) -> kvtier::Error {
    match e {
        kvtier::Error::InvalidArgument { arg, msg } => kvtier::Error::InvalidArgument {
            arg: match arg {
                "context" => "--context",
                "tp" => "--tp",
                "tables" => "--tables",
                "instance_gpus" => "--instance-gpus",
                "miss_rate" => "--miss-rate",
                "link" => "--link-gbps/--step-ms/--link-budget",
                "model" => "--model-file",
                "prices" => "--price-*",
                "prefill" => "--prefill-tokens-per-s",
                other => other,
            },
            msg,
        },
        other => other,
    }
}

fn to_json(p: &Plan, d: &Deployment) -> Value {
    let last = p.capacities.last().expect("DRAM only is always there");
    let configs: Vec<Value> = p
        .capacities
        .iter()
        .map(|c| {
            let per_gpu: serde_json::Map<String, Value> = c
                .per_gpu
                .iter()
                .map(|(l, n)| (l.name().to_string(), json!(n)))
                .collect();
            json!({
                "tiers": c.tiers,
                "host_bytes": c.host_bytes,
                "max_requests": c.max_requests,
                "limited_by": c.limited_by.name(),
                "requests_per_gpu_allowed_by": per_gpu,
                "link_bytes_per_step_per_gpu": c.link_bytes_per_step,
                "link_share_of_step": c.link_share,
            })
        })
        .collect();
    json!({
        "model": p.model.name,
        "source": p.model.source,
        "contexts": d.contexts.iter().map(|(t, w)| json!({"tokens": t, "share": w})).collect::<Vec<_>>(),
        "host_bytes_per_token": p.host_bytes_per_token,
        "hbm_bytes_per_token": p.hbm_bytes_per_token,
        "hot_buffer_bytes_per_request": (p.model.offloaded_layers as u64)
            .saturating_mul(p.model.entry_bytes as u64)
            .saturating_mul(p.model.hot_slots as u64 + p.model.page_entries as u64),
        "host_bytes_per_request": p.host_bytes_per_request,
        "hbm_bytes_per_request": p.hbm_bytes_per_request,
        "max_requests": last.max_requests,
        "limited_by": last.limited_by.name(),
        "hisparse": p.model.offloads(),
        "table_bytes": p.model.table_bytes,
        "tables": (p.model.table_bytes > 0).then(|| json!({
            "placement": d.tables.name(),
            "hbm_bytes_per_gpu": p.table_hbm_per_gpu,
            "host_bytes_per_node": p.table_host_bytes,
        })),
        "configurations": configs,
        "assumptions": {"miss_rate": d.miss_rate, "step_ms": d.step_ms, "link_budget": d.link_budget,
                        "link_gbps": d.link_gbps},
    })
}

fn cost_json(c: &Cost) -> Value {
    let dram_only = c.per_tiers.first().and_then(|t| t.per_million_tokens);
    json!({
        "per_configuration": c.per_tiers.iter().map(|t| json!({
            "tiers": t.tiers,
            "node_per_hour": t.node_per_hour,
            "tokens_per_hour": t.tokens_per_hour,
            "per_million_tokens": t.per_million_tokens,
            "vs_dram_only": t.per_million_tokens.zip(dram_only).map(|(x, base)| x / base),
        })).collect::<Vec<_>>(),
        "recompute": c.recompute.as_ref().map(|r| json!({
            "per_million_context_tokens": r.per_million_context_tokens,
            "keep_per_million_tokens_hour": {"dram": r.keep_per_million_tokens_hour.0,
                                             "cxl": r.keep_per_million_tokens_hour.1},
            "break_even_hours": {"dram": r.break_even_hours.0, "cxl": r.break_even_hours.1},
        })),
    })
}

/// A price with the digits that keep a small one readable.
fn money(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

fn print_cost(c: &Cost) {
    let dram_only = c.per_tiers.first().and_then(|t| t.per_million_tokens);
    for t in &c.per_tiers {
        match t.per_million_tokens {
            Some(per) => println!(
                "cost, {}: {} per million decode tokens (the node {} an hour, {:.0} tokens an hour){}",
                t.tiers,
                money(per),
                money(t.node_per_hour),
                t.tokens_per_hour,
                match dram_only {
                    Some(base) if t.tiers != "DRAM only" =>
                        format!("; {:.2}× DRAM only's", per / base),
                    _ => String::new(),
                }
            ),
            None => println!("cost, {}: the node holds no request", t.tiers),
        }
    }
    if let Some(r) = &c.recompute {
        let hours = |h: Option<f64>| {
            h.map_or("always (memory priced 0)".to_string(), |h| {
                format!("within {h:.1} hours")
            })
        };
        match r.keep_per_million_tokens_hour.1 {
            Some(cxl) => println!(
                "recomputing a context: {} per million tokens re-prefilled; keeping their KV (every TP copy): {} \
                 an hour in DRAM, {} in CXL; keeping is the cheaper when the context is reused {} (DRAM), {} \
                 (CXL)",
                money(r.per_million_context_tokens),
                money(r.keep_per_million_tokens_hour.0),
                money(cxl),
                hours(r.break_even_hours.0),
                hours(r.break_even_hours.1),
            ),
            None => println!(
                "recomputing a context: {} per million tokens re-prefilled; keeping their KV (every TP copy): {} \
                 an hour in DRAM; keeping is the cheaper when the context is reused {}",
                money(r.per_million_context_tokens),
                money(r.keep_per_million_tokens_hour.0),
                hours(r.break_even_hours.0),
            ),
        }
    }
}

fn print_table(p: &Plan, d: &Deployment, rate: &MissRate) {
    let m = &p.model;
    println!("{} ({})", m.name, m.source);
    let mix: Vec<String> = d
        .contexts
        .iter()
        .map(|(t, w)| format!("{t} tokens × {w}"))
        .collect();
    println!(
        "contexts: {}; {} GPUs, attention TP {}",
        mix.join(", "),
        d.gpus,
        d.tp
    );
    let fixed = if m.hbm_bytes_per_request == 0 {
        String::new()
    } else {
        format!(
            ", and {} a request whatever its length",
            human_size(m.hbm_bytes_per_request)
        )
    };
    if m.offloads() {
        println!(
            "per token: host {} B, HBM {} B (indexer keys{}); per request: host {}, HBM {} (HOT buffer of {} slots \
             included{fixed})",
            p.host_bytes_per_token,
            p.hbm_bytes_per_token,
            if m.resident_layers.is_empty() {
                ""
            } else {
                ", layers kept in HBM"
            },
            human_size(p.host_bytes_per_request as u64),
            human_size(p.hbm_bytes_per_request as u64),
            m.hot_slots,
        );
    } else {
        println!(
            "per token: HBM {} B (the whole KV); per request: HBM {} ({} of it whatever its length)",
            p.hbm_bytes_per_token,
            human_size(p.hbm_bytes_per_request as u64),
            human_size(m.hbm_bytes_per_request),
        );
    }
    if !m.offloads() {
        println!(
            "no HiSparse for this model in SGLang: its whole KV stays in HBM, so host memory and the link hold \
             no KV"
        );
    }
    if m.table_bytes > 0 {
        println!(
            "static tables: {} a copy, {}: {} of HBM a GPU, {} of the node's host memory",
            human_size(m.table_bytes),
            d.tables.describe(),
            human_size(p.table_hbm_per_gpu),
            human_size(p.table_host_bytes)
        );
        for other in TablePlacement::ALL {
            if other == d.tables {
                continue;
            }
            if let Ok(q) = plan(
                m,
                &Deployment {
                    tables: other,
                    ..d.clone()
                },
            ) {
                let c = q.capacities.last().expect("DRAM only is always there");
                println!(
                    "  with the tables {}: {} requests, limited by {}",
                    other.describe(),
                    c.max_requests,
                    c.limited_by.name()
                );
            }
        }
    }
    println!(
        "assumed: {} GPUs (--gpus), attention TP {} (--tp), {:.1}% of the top-k missing per layer and step \
         (--miss-rate), {} ms steps (--step-ms), swap-ins in {}% of a step (--link-budget), {} GB/s \
         per GPU (--link-gbps)",
        d.gpus,
        d.tp,
        d.miss_rate * 100.0,
        d.step_ms,
        d.link_budget * 100.0,
        d.link_gbps
    );
    println!("miss rate: {}", rate.describe());
    if m.offloads() {
        let cells: Vec<String> = spread(m, d)
            .iter()
            .map(|(ratio, r, share, n)| {
                format!(
                    "{:.1} % ({ratio}× top-k): link {:.0}% of a step at {n} requests",
                    r * 100.0,
                    share * 100.0
                )
            })
            .collect();
        println!(
            "at the published miss rates instead (DRAM only): {}",
            cells.join("; ")
        );
    }
    if let MissRate::Measured(step) = rate {
        println!("{}", step.describe(d.step_ms));
    }
    println!(
        "{:<11} {:>13}  {:<41}  {:>9}  binds",
        "", "", "requests a GPU as each resource allows", "requests"
    );
    println!(
        "{:<11} {:>13}  {:>9} {:>10} {:>9} {:>9}  {:>9}  first",
        "host tiers", "host KV bytes", "HBM", "host mem", "link", "CXL bw", "a node"
    );
    for c in &p.capacities {
        let cell = |l: kvtier::plan::Limit| {
            c.per_gpu
                .iter()
                .find(|(x, _)| *x == l)
                .and_then(|(_, n)| *n)
                .map_or("-".to_string(), |n| n.to_string())
        };
        use kvtier::plan::Limit::*;
        println!(
            "{:<11} {:>13}  {:>9} {:>10} {:>9} {:>9}  {:>9}  {} (link {:.0}% of a step)",
            c.tiers,
            human_size(c.host_bytes),
            cell(Hbm),
            cell(HostMemory),
            cell(Link),
            cell(CxlBandwidth),
            c.max_requests,
            c.limited_by.name(),
            c.link_share * 100.0
        );
    }
    println!(
        "(host KV bytes: the node's host memory for KV, DRAM and CXL; host mem: requests a GPU by that memory)"
    );
}

/// Requests per node against context length (4K to the model's longest),
/// one line per tier set.
fn draw(
    path: &std::path::Path,
    font: Option<&std::path::Path>,
    m: &ModelSpec,
    d: &Deployment,
) -> kvtier::Result<()> {
    use plotters::prelude::*;
    super::bench::register_font(font)?;
    let mut lengths = Vec::new();
    let mut t = 4096u64;
    while t < m.max_context {
        lengths.push(t);
        t = t.saturating_mul(2);
    }
    lengths.push(m.max_context);
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for &t in &lengths {
        let p = plan(
            m,
            &Deployment {
                contexts: vec![(t, 1.0)],
                ..d.clone()
            },
        )?;
        for c in &p.capacities {
            let label = format!("{} ({})", c.tiers, human_size(c.host_bytes));
            match series.iter_mut().find(|s| s.0 == label) {
                Some(s) => s.1.push((t as f64, c.max_requests as f64)),
                None => series.push((label, vec![(t as f64, c.max_requests as f64)])),
            }
        }
    }
    let err = |e: String| kvtier::Error::Io {
        context: format!("drawing {}", path.display()),
        source: std::io::Error::other(e),
    };
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let ymax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "kvtier plan — {}: requests per node ({} GPUs, TP {})",
                m.name, d.gpus, d.tp
            ),
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((4096f64..m.max_context as f64).log_scale(), 0f64..ymax)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("context length (tokens)")
        .y_desc("requests at once")
        .x_label_formatter(&|v| format!("{}K", (*v as u64) >> 10))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (n, (label, pts)) in series.iter().enumerate() {
        let color = super::bench::PALETTE[n % super::bench::PALETTE.len()].to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// The miss rate a plan assumes, and where it comes from.
enum MissRate {
    Given(f64),
    Published(kvtier::plan::PublishedMissRate),
    Measured(MeasuredStep),
}

impl MissRate {
    fn choose(a: &PlanArgs, m: &ModelSpec) -> kvtier::Result<MissRate> {
        if let Some(r) = a.miss_rate {
            return Ok(MissRate::Given(r));
        }
        if let Some(path) = &a.decode_step {
            return MeasuredStep::read(path).map(MissRate::Measured);
        }
        if !m.offloads() {
            // nothing offloaded, nothing missed: the rate is never used
            return Ok(MissRate::Given(0.0));
        }
        kvtier::plan::PublishedMissRate::for_buffer(m.hot_slots, m.top_k)
            .map(MissRate::Published)
            .map_err(in_the_users_words)
    }

    fn rate(&self) -> f64 {
        match self {
            MissRate::Given(r) => *r,
            MissRate::Published(p) => p.rate,
            MissRate::Measured(s) => s.miss_rate(),
        }
    }

    fn describe(&self) -> String {
        match self {
            MissRate::Given(r) => format!(
                "{:.1} % of the top-k per layer and step (--miss-rate)",
                r * 100.0
            ),
            MissRate::Published(p) => format!("{} (--miss-rate to assume another)", p.describe()),
            MissRate::Measured(s) => format!(
                "{:.2} % of the top-k per layer and step, measured by the decode step in {} ({})",
                s.miss_rate() * 100.0,
                s.path,
                s.what
            ),
        }
    }
}

/// The plan at each published miss rate: (hot / top-k, rate, link share of
/// a step, requests a node) for the DRAM-only configuration.
fn spread(m: &ModelSpec, d: &Deployment) -> Vec<(f64, f64, f64, u64)> {
    kvtier::plan::PUBLISHED_MISS_RATES
        .iter()
        .filter_map(|&(ratio, r)| {
            let p = plan(
                m,
                &Deployment {
                    miss_rate: r,
                    ..d.clone()
                },
            )
            .ok()?;
            let c = p.capacities.first()?;
            Some((ratio, r, c.link_share, c.max_requests))
        })
        .collect()
}

/// What `kvtier bench --scenario decode-step` measured, as `plan` uses it:
/// kvtier's line for all the steps of its largest batch.
struct MeasuredStep {
    path: String,
    what: String,
    misses: f64,
    entries: f64,
    steps: f64,
    median_us: f64,
    device: String,
}

impl MeasuredStep {
    fn read(path: &std::path::Path) -> kvtier::Result<MeasuredStep> {
        let err = |msg: String| arg_err("--decode-step", format!("{}: {msg}", path.display()));
        let text =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        let mut best: Option<(u64, MeasuredStep)> = None;
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: Value = serde_json::from_str(line)
                .map_err(|e| err(format!("line {}: not JSON: {e}", i + 1)))?;
            let p = &v["params"];
            if v["scenario"] != "decode-step"
                || !v["method"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(super::bench::DECODE_STEP_KVTIER_METHOD))
                || p["step"] != "all"
            {
                continue;
            }
            let num = |x: &Value, key: &str| {
                x[key]
                    .as_f64()
                    .filter(|n| n.is_finite() && *n >= 0.0)
                    .ok_or_else(|| {
                        err(format!(
                            "line {}: `{key}` is missing or not a number",
                            i + 1
                        ))
                    })
            };
            let batch = num(p, "batch")? as u64;
            let s = MeasuredStep {
                path: path.display().to_string(),
                what: format!(
                    "{} at batch {batch}, {} on {}",
                    p["source"].as_str().unwrap_or("a trace"),
                    v["executor"].as_str().unwrap_or("?"),
                    v["device"].as_str().unwrap_or("?")
                ),
                misses: num(p, "misses_total")?,
                entries: num(p, "entries_total")?,
                steps: num(p, "measured_steps")?,
                median_us: num(&v, "median_us")?,
                device: v["device"].as_str().unwrap_or("?").to_string(),
            };
            if s.entries == 0.0 || s.steps == 0.0 {
                return Err(err(format!(
                    "line {}: a decode step of no entries or no steps",
                    i + 1
                )));
            }
            if best.as_ref().is_none_or(|(b, _)| batch > *b) {
                best = Some((batch, s));
            }
        }
        best.map(|(_, s)| s).ok_or_else(|| {
            err(format!(
                "no line of kvtier's decode step over all steps (scenario decode-step, a method beginning \"{}\", \
                 step \"all\")",
                super::bench::DECODE_STEP_KVTIER_METHOD
            ))
        })
    }

    fn miss_rate(&self) -> f64 {
        self.misses / self.entries
    }

    fn step_ms(&self) -> f64 {
        self.median_us / self.steps / 1e3
    }

    fn describe(&self, step_ms: f64) -> String {
        format!(
            "measured: a decode step's swap-ins took {:.3} ms on {} ({}), {:.1}% of a {step_ms} ms step",
            self.step_ms(),
            self.device,
            self.what,
            self.step_ms() / step_ms * 100.0
        )
    }

    fn to_json(&self, step_ms: f64) -> Value {
        json!({"file": self.path, "what": self.what, "miss_rate": self.miss_rate(),
               "swap_in_ms_per_step": self.step_ms(), "share_of_step": self.step_ms() / step_ms})
    }
}
