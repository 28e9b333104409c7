//! `kvreplay slurm`: the job array and the dependent merge job for a sweep
//! file, with resources from the plan's estimated cost; and `merge`'s report
//! of the shards still missing.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};

use kvreplay_analysis::sweep::{MergeReport, ShardStatus};

#[derive(Args)]
pub(super) struct SlurmArgs {
    /// The sweep file (TOML: traces, policies, budgets).
    #[arg(long)]
    file: PathBuf,
    /// Number of shards (array tasks).
    #[arg(long, default_value_t = 4)]
    shards: usize,
    /// The merged sweep folder; shard i writes OUT/shards/i.
    #[arg(long)]
    out: PathBuf,
    /// Where to write the job scripts (default OUT/slurm).
    #[arg(long)]
    jobs: Option<PathBuf>,
    /// Slurm partition (default: the cluster's default partition).
    #[arg(long)]
    partition: Option<String>,
    /// CPUs per shard task (default: from the estimated cost, 1 to 8).
    #[arg(long)]
    cpus_per_task: Option<usize>,
    /// Memory per task in MiB (default: from the largest trace).
    #[arg(long)]
    mem_mb: Option<u64>,
    /// Time limit per shard task in minutes (default: from the estimated cost, with a wide margin).
    #[arg(long)]
    time_min: Option<u64>,
    /// Submit the array and the merge job now (runs JOBS/submit.sh).
    #[arg(long)]
    submit: bool,
}

/// Seconds one core takes per unit of estimated cost (`kvreplay_analysis::cost`
/// is calibrated in nanoseconds of one core; BENCHMARKS.md, "Sharding").
const SECONDS_PER_UNIT: f64 = 1.0e-9;

fn abs(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()
            .context("reading the current directory")?
            .join(p))
    }
}

/// A word for a bash script, single-quoted where needed.
fn sh(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn shp(p: &Path) -> String {
    sh(&p.to_string_lossy())
}

pub(super) fn cmd_slurm(a: SlurmArgs) -> Result<()> {
    if a.shards == 0 {
        bail!("--shards must be at least 1");
    }
    let plan = super::sweep::plan_of_file(&a.file)?;
    let asg = plan.assignment(a.shards);
    let heaviest = asg.loads.iter().copied().max().unwrap_or(0);
    let core_s = heaviest as f64 * SECONDS_PER_UNIT;
    // enough CPUs that the heaviest shard's estimate is ~10 minutes, 1 to 8
    // (layers replay in parallel; beyond 8 little is gained)
    let cpus = a
        .cpus_per_task
        .unwrap_or_else(|| ((core_s / 600.0).ceil() as usize).clamp(1, 8));
    if cpus == 0 {
        bail!("--cpus-per-task must be at least 1");
    }
    let mem_mb = a
        .mem_mb
        .unwrap_or_else(|| plan.memory_estimate().div_ceil(1 << 20));
    // three times the estimate on the given CPUs, plus 10 minutes
    let time_min = a
        .time_min
        .unwrap_or_else(|| (3.0 * core_s / cpus as f64 / 60.0).ceil() as u64 + 10);

    let exe = std::env::current_exe().context("finding the kvreplay executable")?;
    let cwd = std::env::current_dir().context("reading the current directory")?;
    let file = abs(&a.file)?;
    let out = abs(&a.out)?;
    let jobs = abs(&a.jobs.clone().unwrap_or_else(|| a.out.join("slurm")))?;
    let logs = jobs.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let n = a.shards;
    let partition = a.partition.as_ref().map_or(String::new(), |p| {
        format!("#SBATCH --partition={}\n", sh(p))
    });
    let shards = format!(
        "#!/bin/bash\n\
         # kvreplay sweep {file}: shard ${{SLURM_ARRAY_TASK_ID}} of {n}, into {out}/shards/ID.\n\
         # Estimated cost of the heaviest shard: {core_s:.0} s on one core.\n\
         #SBATCH --job-name=kvreplay-shards\n\
         #SBATCH --array=0-{last}\n\
         #SBATCH --cpus-per-task={cpus}\n\
         #SBATCH --mem={mem_mb}M\n\
         #SBATCH --time={time_min}\n\
         #SBATCH --requeue\n\
         {partition}\
         #SBATCH --chdir={cwd}\n\
         #SBATCH --output={logs}/shard-%a-%A.out\n\
         set -euo pipefail\n\
         export KVREPLAY_RESUBMIT={submit}\n\
         # --shard auto/{n}: the index from the array, the count given, so a resubmission\n\
         # of some shards (sbatch --array=1,3) runs the same split; --wait makes a\n\
         # duplicated task wait for the running one and then find its points done.\n\
         exec {exe} --threads \"${{SLURM_CPUS_PER_TASK:-1}}\" sweep --file {file} \\\n    \
         --shard auto/{n} --wait --out {out}/shards/\"${{SLURM_ARRAY_TASK_ID}}\"\n",
        file = shp(&file),
        out = shp(&out),
        last = n - 1,
        cwd = shp(&cwd),
        logs = shp(&logs),
        submit = shp(&jobs.join("submit.sh")),
        exe = shp(&exe),
    );
    let merge = format!(
        "#!/bin/bash\n\
         # Merge the shards of {file} into {out}; fails, naming the missing shards, if any is.\n\
         #SBATCH --job-name=kvreplay-merge\n\
         #SBATCH --cpus-per-task=1\n\
         #SBATCH --mem={mem_mb}M\n\
         #SBATCH --time=30\n\
         {partition}\
         #SBATCH --chdir={cwd}\n\
         #SBATCH --output={logs}/merge-%j.out\n\
         set -euo pipefail\n\
         shopt -s nullglob\n\
         folders=({out}/shards/*/)\n\
         if [ ${{#folders[@]}} -eq 0 ]; then echo \"no shard folders in {out}/shards\" >&2; exit 1; fi\n\
         exec {exe} merge \"${{folders[@]}}\" --out {out}\n",
        file = shp(&file),
        out = shp(&out),
        cwd = shp(&cwd),
        logs = shp(&logs),
        exe = shp(&exe),
    );
    let submit = format!(
        "#!/bin/bash\n\
         # Submit the {n} shards of {file} (or only those given: submit.sh 1 3) and the\n\
         # merge job, which runs once they all succeeded. Prints: shards=ID merge=ID\n\
         set -euo pipefail\n\
         array=0-{last}\n\
         if [ $# -gt 0 ]; then array=$(IFS=,; echo \"$*\"); fi\n\
         jid=$(sbatch --parsable --array=\"$array\" {jobs}/shards.sbatch)\n\
         jid=${{jid%%;*}}\n\
         mid=$(sbatch --parsable --dependency=afterok:\"$jid\" {jobs}/merge.sbatch)\n\
         mid=${{mid%%;*}}\n\
         echo \"shards=$jid merge=$mid\"\n",
        file = shp(&file),
        last = n - 1,
        jobs = shp(&jobs),
    );
    for (name, text) in [
        ("shards.sbatch", &shards),
        ("merge.sbatch", &merge),
        ("submit.sh", &submit),
    ] {
        let path = jobs.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
    }
    println!(
        "{} points in {n} shards: estimated {:.0} s on one core for the heaviest \
         (imbalance {:.2}: heaviest / mean); each shard task asks for --cpus-per-task={cpus} --mem={mem_mb}M --time={time_min}",
        asg.shard_of.len(),
        core_s,
        asg.imbalance()
    );
    println!(
        "wrote {0}/shards.sbatch, {0}/merge.sbatch and {0}/submit.sh",
        jobs.display()
    );
    if a.submit {
        let st = std::process::Command::new(jobs.join("submit.sh"))
            .status()
            .context("running submit.sh (is sbatch on PATH?)")?;
        if !st.success() {
            bail!("{}/submit.sh failed ({st})", jobs.display());
        }
    } else {
        println!("submit with {}/submit.sh", jobs.display());
    }
    Ok(())
}

/// The command that reruns `s`, from a recorded shard command: its `--shard`
/// and `--out` replaced.
fn rerun_command(s: &ShardStatus) -> Option<String> {
    let rec = s.record.as_ref()?;
    if rec.command.is_empty() {
        return None;
    }
    let folder = s.folders.first().map(|f| f.to_string_lossy().into_owned());
    let mut words = Vec::new();
    let mut it = rec.command.iter().peekable();
    while let Some(w) = it.next() {
        match w.as_str() {
            "--shard" => {
                it.next();
                words.push(w.clone());
                words.push(format!("{}/{}", s.shard.index, s.shard.count));
            }
            "--out" => {
                let old = it.next().cloned().unwrap_or_default();
                words.push(w.clone());
                words.push(folder.clone().unwrap_or_else(|| {
                    // a folder named after its shard index: the same pattern
                    let p = Path::new(&old);
                    if p.file_name().and_then(|n| n.to_str())
                        == Some(rec.shard.index.to_string().as_str())
                    {
                        p.with_file_name(s.shard.index.to_string())
                            .to_string_lossy()
                            .into_owned()
                    } else {
                        format!("<a folder for shard {}>", s.shard.index)
                    }
                }));
            }
            _ => words.push(w.clone()),
        }
    }
    Some(words.iter().map(|w| sh(w)).collect::<Vec<_>>().join(" "))
}

/// What `merge` says when points are missing: which shards, and how to rerun
/// only those.
pub(super) fn missing_message(r: &MergeReport, out: &Path) -> String {
    let mut m = format!(
        "{} of {} points are missing from {} (its CSVs hold the other {})",
        r.missing,
        r.points,
        out.display(),
        r.points - r.missing
    );
    let bad: Vec<&ShardStatus> = r.incomplete().collect();
    if bad.is_empty() {
        m.push_str(
            "; the folders record no shards: rerun the sweep into one of them, then merge again",
        );
        return m;
    }
    m.push_str(":\n");
    for s in &bad {
        if s.folders.is_empty() {
            m.push_str(&format!(
                "  shard {}/{}: no folder of it was given ({} points)\n",
                s.shard.index, s.shard.count, s.points
            ));
        } else {
            m.push_str(&format!(
                "  shard {}/{}: {} of its {} points missing in {} (stopped or failed before the end)\n",
                s.shard.index,
                s.shard.count,
                s.missing,
                s.points,
                s.folders
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    let indices: Vec<String> = bad.iter().map(|s| s.shard.index.to_string()).collect();
    m.push_str("rerun only these shards (finished points are kept), then merge again:\n");
    if let Some(script) = bad
        .iter()
        .find_map(|s| s.record.as_ref().and_then(|r| r.resubmit.clone()))
    {
        m.push_str(&format!(
            "  {} {}    # the shards and then the merge, under Slurm\n",
            sh(&script),
            indices.join(" ")
        ));
    }
    for s in &bad {
        match rerun_command(s) {
            Some(c) => m.push_str(&format!("  {c}\n")),
            None => m.push_str(&format!(
                "  kvreplay sweep <the same sweep> --shard {}/{} --out <its folder>\n",
                s.shard.index, s.shard.count
            )),
        }
    }
    m.trim_end().to_string()
}
