//! `outbox-bench burst`: the fresh-table burst. The same backlog (by default
//! 110,000 pending rows over 11,000 keys, 10 per key) drained by the same relays (2, no-op
//! broker) on a table whose statistics are fresh (`--stats analyzed`), absent (`none`: created
//! by the schema creation, filled, never analysed) or stale (`stale`: analysed when it held
//! 1,000 completed rows); each run in its own child process, every state of one repetition back
//! to back, for both delivery modes. Prints the JSON lines and a table of median drain times and
//! the ratios to the analysed table (target ≤ 1.2).

use std::collections::BTreeMap;

use clap::Args;

use crate::BenchError;
use crate::suite::{child, load_avg, median};

#[derive(Args, Debug, Clone)]
pub struct BurstArgs {
    /// Repetitions; medians are over these.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Pending rows of the burst.
    #[arg(long, default_value_t = 110_000)]
    pub events: usize,
    /// Keys of the burst (event i on key i mod keys).
    #[arg(long, default_value_t = 11_000)]
    pub keys: usize,
    /// Relays draining it.
    #[arg(long, default_value_t = 2)]
    pub relays: usize,
    /// Rows per fetch.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Append every JSON line to this file.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

const STATES: [&str; 3] = ["analyzed", "none", "stale"];
const DELIVERIES: [&str; 2] = ["lease", "transaction"];

pub async fn burst(a: BurstArgs) -> Result<(), BenchError> {
    let mut results: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    let mut lines = Vec::new();
    for rep in 0..a.runs {
        eprintln!(
            "burst repetition {} of {} (load {})",
            rep + 1,
            a.runs,
            load_avg()
        );
        for delivery in DELIVERIES {
            for stats in STATES {
                let args: Vec<String> = format!(
                    "--mode relay --store sqlx --broker noop --relays {} --events {} --keys {} --batch {} --delivery {delivery} --stats {stats}",
                    a.relays, a.events, a.keys, a.batch
                )
                .split_whitespace()
                .map(str::to_owned)
                .collect();
                let v = child(&args).await?;
                if v["not_completed"] != 0 {
                    return Err(BenchError(format!("the burst was not drained: {v}")));
                }
                let line = serde_json::json!({
                    "name": format!("burst_{delivery}_{stats}"),
                    "rep": rep,
                    "load": load_avg(),
                    "run": v,
                });
                println!("{line}");
                lines.push(line.to_string());
                results
                    .entry((delivery, stats))
                    .or_default()
                    .push(v["seconds"].as_f64().unwrap_or(f64::NAN));
            }
        }
    }
    if let Some(p) = &a.out {
        let mut text = lines.join("\n");
        text.push('\n');
        use std::io::Write;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| BenchError(format!("{}: {e}", p.display())))?;
    }
    println!();
    println!(
        "Burst: {} pending rows over {} keys, {} relays, batch {}, no-op broker; median drain seconds of {} repetitions; ratios per repetition, then the median.",
        a.events, a.keys, a.relays, a.batch, a.runs
    );
    println!();
    println!(
        "| delivery | analysed s | no statistics s | ratio | stale statistics s | ratio | goal | holds |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for delivery in DELIVERIES {
        let get = |s: &str| results.get(&(delivery, s)).cloned().unwrap_or_default();
        let base = get("analyzed");
        let ratio = |s: &str| {
            median(
                get(s)
                    .iter()
                    .zip(&base)
                    .map(|(x, b)| x / b)
                    .collect::<Vec<_>>(),
            )
        };
        let (rn, rs) = (ratio("none"), ratio("stale"));
        let fmt = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.2}"));
        let holds = rn.is_some_and(|r| r <= 1.2) && rs.is_some_and(|r| r <= 1.2);
        println!(
            "| {delivery} | {} | {} | {} | {} | {} | ≤ 1.2 | {} |",
            fmt(median(base.clone())),
            fmt(median(get("none"))),
            fmt(rn),
            fmt(median(get("stale"))),
            fmt(rs),
            if holds { "yes" } else { "**no**" }
        );
    }
    Ok(())
}
