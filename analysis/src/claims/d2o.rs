//! D2O (dynamic discriminative operations): claims D1-D9 (D10 removed: see mod.rs).

use kvreplay_replay::ReplayError;

use kvreplay_replay::select::cmp_f64;

use super::ctx::{b0, fmt, Claim, Ctx, Verdict};
use crate::stats::{mean, spearman};

pub(super) fn d2o(c: &mut Ctx, out: &mut Vec<Claim>) -> Result<(), ReplayError> {
    let (p, nl, nh) = (c.p, c.layers.len(), c.n_heads());
    let mut var = vec![];
    let mut top10 = vec![];
    for l in 0..nl {
        let (mut v, mut t) = (0.0, 0.0);
        for h in 0..nh {
            let s = c.colsum(l, h);
            let m = mean(&s);
            v += s.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (p as f64 - 1.0);
            let mut sorted = s.clone();
            sorted.sort_by(|a, b| cmp_f64(*b, *a));
            t += sorted[..(p / 10).max(1)].iter().sum::<f64>() / sorted.iter().sum::<f64>();
        }
        var.push(v / nh as f64);
        top10.push(t / nh as f64);
    }
    let depth: Vec<f64> = (0..nl).map(|l| l as f64).collect();
    let rho = spearman(&depth, &var);
    out.push(Claim {
        method: "d2o",
        id: "D1",
        claim: "shallow (and some middle) layers have lower variance of accumulated attention than deep layers",
        paper: "Fig. 4".into(),
        measured: format!("Spearman(depth, head-mean variance) = {rho:.2}; layers 0-2 {:.1}, last 3 {:.1} (full prompt, no replay)", mean(&var[..3.min(nl)]), mean(&var[nl.saturating_sub(3)..])),
        verdict: if rho > 0.3 { Verdict::Agrees } else if rho > 0.0 { Verdict::Partly } else { Verdict::Disagrees },
    });
    let rho = spearman(&depth, &top10);
    out.push(Claim {
        method: "d2o",
        id: "D2",
        claim: "shallow layers attend densely, deep layers sparsely",
        paper: "Fig. 1, 9".into(),
        measured: format!("share of column-sum mass on the top 10% keys: layers 0-1 {:.3}, last 2 {:.3}; Spearman with depth {rho:.2} (full prompt, no replay)", mean(&top10[..2.min(nl)]), mean(&top10[nl.saturating_sub(2)..])),
        verdict: if rho > 0.3 { Verdict::Agrees } else if rho > 0.0 { Verdict::Partly } else { Verdict::Disagrees },
    });
    let b = b0(p);
    // D3 at equal real memory: the clamp of r_l (and no redistribution of the
    // excess) makes the variants keep different amounts at one nominal budget,
    // so each runs at the largest budget keeping no more than uniform at B.
    let variants = [
        "d2o",
        "d2o:allocation=reciprocal",
        "d2o:allocation=uniform",
        "d2o:allocation=exp_decay",
    ];
    let target = c.run("d2o:allocation=uniform", b)?.bytes;
    let (mut e, mut bs, mut ms) = (vec![], vec![], vec![]);
    for v in variants {
        let bb = c.budget_for_bytes(v, target)?;
        e.push(c.err(v, bb)?);
        ms.push(c.mem(v, bb)?);
        bs.push(bb);
    }
    let target_mem = c.mem("d2o:allocation=uniform", b)?;
    out.push(Claim {
        method: "d2o",
        id: "D3",
        claim: "allocation: inverse-variance softmax > reciprocal > uniform > exponential decay",
        paper: "Table 4".into(),
        measured: format!(
            "rel_l2 inv-var softmax / reciprocal / uniform / exp decay: {}, at equal real memory (at most uniform's {:.1}% at B = {b}): nominal B = {bs:?} entries/KV head (P = {p}) keep {} of the full cache",
            fmt(&e),
            100.0 * target_mem,
            ms.iter()
                .map(|m| format!(
                    "{:.1}%{}",
                    100.0 * m,
                    if *m < 0.95 * target_mem { " (its most at any B ≤ P)" } else { "" }
                ))
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        verdict: if e.windows(2).all(|w| w[0] <= w[1]) {
            Verdict::Agrees
        } else if e[0] <= e[2] {
            Verdict::Partly
        } else {
            Verdict::Disagrees
        },
    });
    let specs = [
        "d2o",
        "d2o:allocation=uniform",
        "d2o:threshold=none",
        "d2o:allocation=uniform,threshold=none",
        "h2o",
    ];
    let e = c.errs(&specs, b)?;
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "d2o",
        id: "D4",
        claim: "both the layer operation and the EMA threshold help; D2O beats H2O",
        paper: "Table 6".into(),
        measured: format!(
            "rel_l2 D2O / w.o. layer / w.o. EMA / w.o. both / H2O: {}; {at}",
            fmt(&e)
        ),
        verdict: match (e[0] <= e[1], e[0] <= e[2], e[0] <= e[4]) {
            (true, true, true) => Verdict::Agrees,
            (false, false, false) => Verdict::Disagrees,
            _ => Verdict::Partly,
        },
    });
    let specs = ["d2o", "d2o:match_on=values"];
    let e = c.errs(&specs, b)?;
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "d2o",
        id: "D5",
        claim: "matching on keys beats matching on values",
        paper: "Table 7".into(),
        measured: format!("rel_l2 keys / values: {}; {at}", fmt(&e)),
        verdict: Verdict::of(e[0] <= e[1]),
    });
    let specs = ["d2o", "d2o:merge=average"];
    let e = c.errs(&specs, b)?;
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "d2o",
        id: "D6",
        claim: "weighted merging beats plain averaging",
        paper: "Table 8".into(),
        measured: format!("rel_l2 weighted / average: {}; {at}", fmt(&e)),
        verdict: Verdict::of(e[0] <= e[1]),
    });
    let specs = ["d2o", "d2o:f=0.5", "d2o:f=0.25"];
    let e = c.errs(&specs, b)?;
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "d2o",
        id: "D7",
        claim: "an N:M split of 3:1 beats 1:1 and 1:3",
        paper: "Tables 9, 10".into(),
        measured: format!("rel_l2 3:1 / 1:1 / 1:3: {}; {at}", fmt(&e)),
        verdict: Verdict::of(e[0] <= e[1] && e[0] <= e[2]),
    });
    let specs = ["d2o:beta=0.5", "d2o:beta=0.7", "d2o:beta=0.9"];
    let e = c.errs(&specs, b)?;
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "d2o",
        id: "D8",
        claim: "β ≈ 0.6-0.7 is best",
        paper: "Table 11".into(),
        measured: format!("rel_l2 β = 0.5 / 0.7 / 0.9: {}; {at}", fmt(&e)),
        verdict: Verdict::of(e[1] <= e[0] && e[1] <= e[2]),
    });
    // D9: with more of the prompt evicted, merging should matter more: D2O's
    // lead over H2O (same budget, no merging) grows as the budget shrinks.
    let budgets = [p / 2, p / 4, p / 8].map(|x| x.max(16));
    let (mut ed, mut eh) = (vec![], vec![]);
    for &bb in &budgets {
        ed.push(c.err("d2o", bb)?);
        eh.push(c.err("h2o", bb)?);
    }
    let gap: Vec<f64> = eh.iter().zip(&ed).map(|(h, d)| h - d).collect();
    let mems: Vec<String> = budgets
        .iter()
        .map(|&bb| Ok(format!("{:.0}%", 100.0 * c.mem("d2o", bb)?)))
        .collect::<Result<_, ReplayError>>()?;
    let (beats, widens) = (gap.iter().all(|g| *g > 0.0), gap[2] > gap[0]);
    out.push(Claim {
        method: "d2o",
        id: "D9",
        claim: "merging keeps long-range information: D2O's lead over H2O grows as more of the prompt is evicted",
        paper: "Fig. 6, 8 (D2O flat with context length, H2O degrades)".into(),
        measured: format!(
            "rel_l2 D2O / H2O at B = {budgets:?} entries/KV head (P = {p}; D2O memory {} of the full cache): {} / {} / {}; H2O − D2O: {}",
            mems.join(" / "),
            fmt(&[ed[0], eh[0]]),
            fmt(&[ed[1], eh[1]]),
            fmt(&[ed[2], eh[2]]),
            fmt(&gap)
        ),
        verdict: match (beats, widens) {
            (true, true) => Verdict::Agrees,
            (false, false) => Verdict::Disagrees,
            _ => Verdict::Partly,
        },
    });
    Ok(())
}
