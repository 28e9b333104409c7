//! `kvreplay claims`: print the seed papers' claims measured on a trace.

use anyhow::{Context, Result};
use std::path::Path;

use kvreplay_traces::Trace;

pub(super) fn cmd_claims(dir: &Path, json: Option<&Path>) -> Result<()> {
    let trace = Trace::open(dir).with_context(|| format!("opening trace {}", dir.display()))?;
    let m = &trace.manifest;
    eprintln!("measuring claims on {} ({} prompt + {} decode tokens); replays run at B = P/4 unless stated", dir.display(), m.prompt_len(), m.generation.n_decode);
    let claims = kvreplay_analysis::claims::measure(&trace)
        .with_context(|| format!("measuring claims on {}", dir.display()))?;
    for c in &claims {
        println!("[{}] {} {}: {}", c.verdict.label(), c.method, c.id, c.claim);
        println!("      paper:    {}", c.paper);
        println!("      measured: {}", c.measured);
    }
    let count = |v| claims.iter().filter(|c| c.verdict == v).count();
    use kvreplay_analysis::claims::Verdict;
    println!(
        "{} claims: {} agree, {} partly, {} disagree, {} not checkable on this trace",
        claims.len(),
        count(Verdict::Agrees),
        count(Verdict::Partly),
        count(Verdict::Disagrees),
        count(Verdict::NotCheckable)
    );
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&claims).expect("claims serialise");
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
