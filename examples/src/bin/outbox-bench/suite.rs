//! The standard set (targets 1 to 6 of `examples/BENCHMARKS.md`): every measurement of one
//! repetition runs back to back (so each ratio compares runs made under the same load), each in
//! its own child process (so peak RSS is the run's own); then a table of medians and ratios.

use std::collections::BTreeMap;
use std::io::Write;

use clap::Args;
use serde_json::Value;

use crate::BenchError;

#[derive(Args, Debug, Clone)]
pub struct SuiteArgs {
    /// Repetitions of the set (targets 1 to 5); medians are over these.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Skip target 6 (draining 1,000,000 events, a few minutes).
    #[arg(long)]
    pub skip_memory: bool,
    /// Skip the NATS and Redis measurements (target 5).
    #[arg(long)]
    pub skip_brokers: bool,
    /// Events of the memory run.
    #[arg(long, default_value_t = 1_000_000)]
    pub memory_events: usize,
    /// Append every JSON line to this file.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// One measurement: a name and its `run` arguments.
struct Spec {
    name: &'static str,
    args: Vec<String>,
}

fn spec(name: &'static str, args: &str) -> Spec {
    Spec {
        name,
        args: args.split_whitespace().map(str::to_owned).collect(),
    }
}

fn standard(brokers: bool) -> Vec<Spec> {
    let t1 = "--events 20000 --keys 1000 --batch 100";
    let one = "--events 100000 --keys 100000 --batch 100";
    let mixed = "--events 20000 --keys 1000 --hot-events 20000 --batch 100";
    let mut v = vec![
        spec("ref_1", &format!("--mode reference --relays 1 {t1}")),
        spec(
            "sqlx_1",
            &format!("--mode relay --store sqlx --relays 1 {t1}"),
        ),
        spec(
            "diesel_1",
            &format!("--mode relay --store diesel --relays 1 {t1}"),
        ),
        spec(
            "lease_1",
            &format!("--mode lease-reference --relays 1 {t1}"),
        ),
        spec("ref_4", &format!("--mode reference --relays 4 {t1}")),
        spec(
            "lease_4",
            &format!("--mode lease-reference --relays 4 {t1}"),
        ),
        spec(
            "sqlx_4",
            &format!("--mode relay --store sqlx --relays 4 {t1}"),
        ),
        spec(
            "diesel_4",
            &format!("--mode relay --store diesel --relays 4 {t1}"),
        ),
        spec(
            "hot_100",
            "--mode relay --store sqlx --relays 1 --events 1000 --keys 1 --batch 100 --max-per-key 100 --check-order",
        ),
        // Delivery in one transaction (R84), the same shapes.
        spec(
            "tx_1",
            &format!("--mode relay --store sqlx --delivery transaction --relays 1 {t1}"),
        ),
        spec(
            "tx_4",
            &format!("--mode relay --store sqlx --delivery transaction --relays 4 {t1}"),
        ),
        spec(
            "dtx_1",
            &format!("--mode relay --store diesel --delivery transaction --relays 1 {t1}"),
        ),
        spec(
            "tx_hot_100",
            "--mode relay --store sqlx --delivery transaction --relays 1 --events 1000 --keys 1 --batch 100 --max-per-key 100 --check-order",
        ),
        spec(
            "tx_one",
            &format!("--mode relay --delivery transaction --relays 1 {one}"),
        ),
        spec(
            "tx_mixed",
            &format!(
                "--mode relay --delivery transaction --relays 1 --max-per-key 100 --check-order {mixed}"
            ),
        ),
        spec("ref_one", &format!("--mode reference --relays 1 {one}")),
        spec("sqlx_one", &format!("--mode relay --relays 1 {one}")),
        spec("ref_mixed", &format!("--mode reference --relays 1 {mixed}")),
        // The hot key alone yields max_per_key rows a cycle: once the other keys are drained,
        // the default of 16 caps a cycle at 16 rows, so this shape runs with max_per_key = batch.
        spec(
            "sqlx_mixed",
            &format!("--mode relay --relays 1 --max-per-key 100 --check-order {mixed}"),
        ),
    ];
    if brokers {
        v.extend([
            spec(
                "raw_nats",
                &format!("--mode raw --broker nats --relays 1 {t1}"),
            ),
            spec(
                "sqlx_nats",
                &format!("--mode relay --broker nats --relays 1 {t1}"),
            ),
            spec(
                "tx_nats",
                &format!("--mode relay --broker nats --delivery transaction --relays 1 {t1}"),
            ),
            spec(
                "tx_redis",
                &format!("--mode relay --broker redis --delivery transaction --relays 1 {t1}"),
            ),
            spec(
                "raw_redis",
                &format!("--mode raw --broker redis --relays 1 {t1}"),
            ),
            spec(
                "sqlx_redis",
                &format!("--mode relay --broker redis --relays 1 {t1}"),
            ),
        ]);
    }
    v
}

pub async fn child(args: &[String]) -> Result<Value, BenchError> {
    let exe = std::env::current_exe().map_err(|e| BenchError(e.to_string()))?;
    let out = tokio::process::Command::new(exe)
        .arg("run")
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .map_err(|e| BenchError(format!("could not start a run: {e}")))?;
    if !out.status.success() {
        return Err(BenchError(format!(
            "run {} failed ({})",
            args.join(" "),
            out.status
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| BenchError(format!("bad JSON line {line:?}: {e}")))
}

pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub async fn suite(a: SuiteArgs) -> Result<(), BenchError> {
    let specs = standard(!a.skip_brokers);
    let mut file = match &a.out {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| BenchError(format!("{}: {e}", p.display())))?,
        ),
        None => None,
    };
    let mut emit = |name: &str, rep: usize, v: &Value| {
        let line = serde_json::json!({ "name": name, "rep": rep, "load": load_avg(), "run": v });
        println!("{line}");
        if let Some(f) = file.as_mut() {
            let _ = writeln!(f, "{line}");
        }
    };
    // results[name][rep]
    let mut results: BTreeMap<&'static str, Vec<Value>> = BTreeMap::new();
    for rep in 0..a.runs {
        eprintln!("repetition {} of {} (load {})", rep + 1, a.runs, load_avg());
        for s in &specs {
            let v = child(&s.args).await?;
            emit(s.name, rep, &v);
            results.entry(s.name).or_default().push(v);
        }
    }
    let mut memory = None;
    if !a.skip_memory {
        let args: Vec<String> = format!(
            "--mode relay --relays 1 --events {} --keys 1000 --batch 100",
            a.memory_events
        )
        .split_whitespace()
        .map(str::to_owned)
        .collect();
        eprintln!(
            "memory run: {} events (load {})",
            a.memory_events,
            load_avg()
        );
        let v = child(&args).await?;
        emit("memory", 0, &v);
        memory = Some(v);
    }
    print_table(&results, memory.as_ref(), a.runs);
    Ok(())
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(f64::NAN)
}

fn print_table(r: &BTreeMap<&'static str, Vec<Value>>, memory: Option<&Value>, runs: usize) {
    let rate = |n: &str| {
        median(
            r.get(n)
                .map(|v| v.iter().map(|x| f(x, "events_per_s")).collect())
                .unwrap_or_default(),
        )
    };
    // Ratio per repetition (same run), then the median of the ratios.
    let ratio = |a: &str, b: &str| {
        let (Some(x), Some(y)) = (r.get(a), r.get(b)) else {
            return None;
        };
        median(
            x.iter()
                .zip(y)
                .map(|(x, y)| f(x, "events_per_s") / f(y, "events_per_s"))
                .collect(),
        )
    };
    let fmt = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.0}"));
    let fr = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.2}"));
    let ok = |v: Option<f64>, goal: f64| match v {
        Some(v) if v >= goal => "yes",
        Some(_) => "**no**",
        None => "–",
    };
    println!();
    println!(
        "Medians of {runs} repetitions (events/s; ratios are per repetition, then the median)."
    );
    println!();
    println!("| target | measured | ev/s | against | ev/s | ratio | goal | holds |");
    println!("|---|---|---:|---|---:|---:|---:|---|");
    let rows: [(&str, &str, &str, &str, f64); 25] = [
        ("1", "sqlx_1", "ref_1", "1 relay vs reference 1 conn", 0.8),
        ("1", "sqlx_4", "ref_4", "4 relays vs reference 4 conns", 0.8),
        (
            "#11",
            "sqlx_1",
            "ref_1",
            "lease mode, 1 relay vs reference",
            0.5,
        ),
        (
            "#11",
            "sqlx_4",
            "sqlx_1",
            "lease mode, 4 relays vs 1 relay",
            1.3,
        ),
        (
            "#12",
            "tx_1",
            "ref_1",
            "transaction mode, 1 relay vs reference",
            0.7,
        ),
        (
            "#12",
            "tx_4",
            "ref_4",
            "transaction mode, 4 relays vs reference 4 conns",
            0.7,
        ),
        (
            "#12",
            "tx_4",
            "tx_1",
            "transaction mode, 4 relays vs 1 relay",
            1.0,
        ),
        (
            "#12",
            "tx_nats",
            "tx_1",
            "transaction mode, NATS e2e vs no-op",
            0.85,
        ),
        (
            "#12",
            "tx_redis",
            "tx_1",
            "transaction mode, Redis e2e vs no-op",
            0.85,
        ),
        (
            "#12",
            "sqlx_nats",
            "sqlx_1",
            "lease mode, NATS e2e vs no-op",
            0.85,
        ),
        (
            "#12",
            "sqlx_redis",
            "sqlx_1",
            "lease mode, Redis e2e vs no-op",
            0.85,
        ),
        (
            "#12",
            "dtx_1",
            "tx_1",
            "transaction mode, diesel vs sqlx",
            0.9,
        ),
        (
            "4",
            "tx_one",
            "ref_one",
            "transaction mode, 100,000 keys of 1 row",
            0.7,
        ),
        (
            "4",
            "tx_mixed",
            "ref_mixed",
            "transaction mode, hot 20,000 + 1,000 × 20",
            0.7,
        ),
        (
            "(1)",
            "lease_1",
            "ref_1",
            "lease-stamping plain SQL vs reference, 1 conn",
            0.0,
        ),
        (
            "(1)",
            "lease_4",
            "ref_4",
            "lease-stamping plain SQL vs reference, 4 conns",
            0.0,
        ),
        (
            "(1)",
            "sqlx_1",
            "lease_1",
            "relay vs lease-stamping plain SQL",
            0.0,
        ),
        (
            "(5)",
            "sqlx_nats",
            "sqlx_1",
            "NATS e2e vs no-op broker",
            0.0,
        ),
        (
            "(5)",
            "sqlx_redis",
            "sqlx_1",
            "Redis e2e vs no-op broker",
            0.0,
        ),
        ("2", "diesel_1", "sqlx_1", "diesel vs sqlx, 1 relay", 0.9),
        ("2", "diesel_4", "sqlx_4", "diesel vs sqlx, 4 relays", 0.9),
        ("4", "sqlx_one", "ref_one", "100,000 keys of 1 row", 0.7),
        (
            "4",
            "sqlx_mixed",
            "ref_mixed",
            "hot 20,000 + 1,000 × 20",
            0.7,
        ),
        (
            "5",
            "sqlx_nats",
            "raw_nats",
            "NATS JetStream e2e vs raw",
            0.5,
        ),
        (
            "5",
            "sqlx_redis",
            "raw_redis",
            "Redis Streams e2e vs raw",
            0.5,
        ),
    ];
    for (t, a, b, what, goal) in rows.iter().filter(|x| !x.1.is_empty()) {
        if !r.contains_key(a) {
            continue;
        }
        let q = ratio(a, b);
        // A goal of 0 marks a row that explains a limit rather than checks a target.
        let (g, holds) = if *goal > 0.0 {
            (format!("≥ {goal}"), ok(q, *goal))
        } else {
            ("–".to_owned(), "(for the analysis)")
        };
        println!(
            "| {t} | {a} ({what}) | {} | {b} | {} | {} | {g} | {holds} |",
            fmt(rate(a)),
            fmt(rate(b)),
            fr(q),
        );
    }
    for n in ["sqlx_4", "diesel_4", "tx_4"] {
        if let Some(v) = r.get(n) {
            let e: Vec<String> = v.iter().map(|x| x["empty_fetches"].to_string()).collect();
            let c: Vec<String> = v.iter().map(|x| x["cycles"].to_string()).collect();
            println!(
                "| (1) | {n}: fetches that returned rows / returned nothing | {} | | {} | | – | (for the analysis) |",
                c.join(", "),
                e.join(", ")
            );
        }
    }
    for n in ["sqlx_4", "tx_4"] {
        if let Some(v) = r.get(n) {
            let share: Vec<f64> = v
                .iter()
                .map(|x| {
                    let (e, c) = (f(x, "empty_fetches"), f(x, "cycles"));
                    100.0 * e / (e + c)
                })
                .collect();
            let m = median(share.clone());
            println!(
                "| #11 | {n}: empty fetches, % of all fetches | {} | | | | ≤ 5 % | {} |",
                m.map_or("–".into(), |m| format!("{m:.1} %")),
                if m.is_some_and(|m| m <= 5.0) {
                    "yes"
                } else {
                    "**no**"
                }
            );
        }
    }
    for (n, what) in [("hot_100", "lease"), ("tx_hot_100", "transaction")] {
        let Some(h) = r.get(n) else { continue };
        let secs = median(h.iter().map(|x| f(x, "seconds")).collect());
        let cycles: Vec<String> = h.iter().map(|x| x["cycles"].to_string()).collect();
        let in_order = h.iter().all(|x| x["in_order"] == Value::Bool(true));
        println!(
            "| 3 | hot key ({what}), 1,000 events, max_per_key 100 | {} s (median) | cycles {} | want 10 | in order: {in_order} | < 0.3 s | {} |",
            secs.map_or("–".into(), |s| format!("{s:.3}")),
            cycles.join(", "),
            if secs.is_some_and(|s| s < 0.3) && in_order && h.iter().all(|x| x["cycles"] == 10) {
                "yes"
            } else {
                "**no**"
            }
        );
    }
    if let Some(m) = memory {
        let mb = f(m, "peak_rss_mb");
        println!(
            "| 6 | peak RSS draining {} events | {mb} MB | {} ev/s | | | < 100 MB | {} |",
            m["events"],
            m["events_per_s"],
            if mb < 100.0 { "yes" } else { "**no**" }
        );
    }
}
