//! MiniCache (merging adjacent layers in depth): claims M1-M4 (M5 removed: see mod.rs).

use kvreplay_replay::{Budget, PolicySpec, ReplayError};

use kvreplay_replay::select::cmp_f64;

use super::ctx::{b0, fmt, Claim, Ctx, Verdict};
use crate::stats::{cosine, mean, spearman};

pub(super) fn minicache(c: &mut Ctx, out: &mut Vec<Claim>) -> Result<(), ReplayError> {
    let (p, nl, nkv) = (c.p, c.layers.len(), c.n_kv());
    let (mut kcos, mut vcos) = (vec![], vec![]);
    let mut token0_rank = vec![];
    let mut deep_median = vec![];
    for l in 1..nl {
        let mut per_tok = vec![0f64; p];
        let mut per_tok_v = vec![0f64; p];
        for g in 0..nkv {
            for (t, x) in per_tok.iter_mut().enumerate() {
                *x += cosine(c.prompt_key(l - 1, g, t), c.prompt_key(l, g, t)) / nkv as f64;
            }
            for (t, x) in per_tok_v.iter_mut().enumerate() {
                *x += cosine(c.prompt_value(l - 1, g, t), c.prompt_value(l, g, t)) / nkv as f64;
            }
        }
        kcos.push(mean(&per_tok));
        vcos.push(mean(&per_tok_v));
        if l >= nl / 2 {
            let mut s = per_tok.clone();
            s.sort_by(|a, b| cmp_f64(*a, *b));
            deep_median.push(s[p / 2]);
            token0_rank.push((per_tok[0] <= s[(p / 20).max(1)]) as u8 as f64);
        }
    }
    let depth: Vec<f64> = (1..nl).map(|l| l as f64).collect();
    let (rk, rv) = (spearman(&depth, &kcos), spearman(&depth, &vcos));
    let ends = |x: &[f64]| {
        (
            mean(&x[..3.min(x.len())]),
            mean(&x[x.len().saturating_sub(3)..]),
        )
    };
    let ((k0, k1), (v0, v1)) = (ends(&kcos), ends(&vcos));
    out.push(Claim {
        method: "minicache",
        id: "M1",
        claim: "adjacent-layer similarity of KV states rises with depth",
        paper: "Fig. 1a: ≈0.2-0.3 at the bottom to ≈0.8-0.9 at the top".into(),
        measured: format!("mean cosine of layers (l−1, l), first 3 pairs → last 3: keys {k0:.2} → {k1:.2} (Spearman with depth {rk:.2}), values {v0:.2} → {v1:.2} (Spearman {rv:.2}); full prompt, no replay"),
        verdict: if rk > 0.3 && rv > 0.3 { Verdict::Agrees } else if rk > 0.0 || rv > 0.0 { Verdict::Partly } else { Verdict::Disagrees },
    });
    out.push(Claim {
        method: "minicache",
        id: "M2",
        claim: "in deep pairs per-token similarity sits near 0.6, token 0 an outlier",
        paper: "Fig. 2b".into(),
        measured: format!("median per-token key cosine in deep pairs {:.2}; token 0 among the 5% least similar in {:.0}% of deep pairs (full prompt, no replay)", mean(&deep_median), 100.0 * mean(&token0_rank)),
        verdict: if (0.4..=0.8).contains(&mean(&deep_median)) && mean(&token0_rank) > 0.5 { Verdict::Agrees } else { Verdict::Partly },
    });
    let b = b0(p);
    // M3 compares errors over the merged layers only: a mean over every layer
    // would rise with the number of merged layers by count alone.
    let merged = |frac: f64| {
        let s = ((nl as f64 * frac).floor() as usize).min(nl);
        s..s + 2 * ((nl - s) / 2)
    };
    let band =
        |c: &mut Ctx, spec: &str, layers: std::ops::Range<usize>| -> Result<f64, ReplayError> {
            let r = c.run(spec, b)?;
            Ok(mean(&r.layer_err[layers]))
        };
    let specs = [
        "minicache:start=0.75",
        "minicache:start=0.5",
        "minicache:start=0.25",
        "minicache:start=0.5,merge=mean",
    ];
    let e: Vec<f64> = [0.75, 0.5, 0.25, 0.5]
        .iter()
        .zip(specs)
        .map(|(f, s)| band(c, s, merged(*f)))
        .collect::<Result<_, _>>()?;
    // per-layer: the layers merged from 1/4 but not from 1/2, against those merged from 1/2
    let (deep, shallow) = (
        band(c, specs[1], merged(0.5))?,
        band(c, specs[2], merged(0.25).start..merged(0.5).start)?,
    );
    let at = c.at(&specs, b)?;
    out.push(Claim {
        method: "minicache",
        id: "M3",
        claim:
            "SLERP beats mean merging, and error stays low until about half the layers are merged",
        paper: "Fig. 1b".into(),
        measured: format!(
            "rel_l2 over the merged layers only, merging from 3/4, 1/2, 1/4 depth (layers {:?}, {:?}, {:?}): {}; Mean-KV from 1/2: {:.3}; per layer: layers {:?} merged from 1/4 {shallow:.3} vs layers {:?} merged from 1/2 {deep:.3}; {at}",
            merged(0.75),
            merged(0.5),
            merged(0.25),
            fmt(&e[..3]),
            e[3],
            merged(0.25).start..merged(0.5).start,
            merged(0.5)
        ),
        // too few layers leave a band without merged layers
        verdict: match (e[1] < e[3], shallow > 2.0 * deep) {
            _ if e.iter().chain([&shallow, &deep]).any(|x| x.is_nan()) => Verdict::NotCheckable,
            (true, true) => Verdict::Agrees,
            (false, false) => Verdict::Disagrees,
            _ => Verdict::Partly,
        },
    });
    // Retention share at γ = 0.05: bits above the merged cost reveal retained positions.
    let pol = PolicySpec::parse("minicache:start=0.5")?.build()?;
    let r = c.tr.replay(pol.as_ref(), Budget::Entries(b))?;
    let d = c.d() as u64;
    let merged_a = 2 * (d * 16 + 16);
    let retained_frac = {
        let s = nl / 2;
        let (mut ret, mut n) = (0usize, 0usize);
        for l in (s..nl).step_by(2) {
            if l + 1 >= nl {
                break;
            }
            let bits_a = r.layers[l].bytes * 8;
            n += 2 * nkv * c.trace.manifest.total_len();
            ret += ((bits_a.saturating_sub(merged_a * (nkv * c.trace.manifest.total_len()) as u64))
                / (d * 16 + 32)) as usize;
        }
        ret as f64 / n.max(1) as f64
    };
    out.push(Claim {
        method: "minicache",
        id: "M4",
        claim: "the retention set is tiny",
        paper: "γ = 0.05: retention ratios 0-1%".into(),
        measured: format!(
            "retained share of (position, half) pairs ≈ {:.1}% (γ = 0.05, merging from 1/2 depth; {})",
            100.0 * retained_frac,
            c.at(&["minicache:start=0.5"], b)?
        ),
        verdict: if retained_frac <= 0.01 {
            Verdict::Agrees
        } else if retained_frac <= 0.05 {
            Verdict::Partly
        } else {
            Verdict::Disagrees
        },
    });
    Ok(())
}
