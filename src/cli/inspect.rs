//! `kvreplay inspect`: a trace's manifest and per-layer shapes and norms.

use anyhow::{Context, Result};
use std::path::Path;

use kvreplay_traces::Trace;

pub(super) fn cmd_inspect(dir: &Path) -> Result<()> {
    let trace = Trace::open(dir).with_context(|| format!("opening trace {}", dir.display()))?;
    let m = &trace.manifest;
    let md = &m.model;
    println!("trace      {}", dir.display());
    println!("format     {} v{}", m.format, m.format_version);
    println!(
        "model      {} ({}), {} layers, {} heads / {} KV heads, head_dim {}",
        md.name.as_deref().unwrap_or("?"),
        md.architecture,
        md.n_layers,
        md.n_heads,
        md.n_kv_heads,
        md.head_dim
    );
    println!(
        "source     {} ({} bytes, sha256 {})",
        md.source.file_name, md.source.size, md.source.sha256
    );
    println!(
        "rope       theta {}, {:?}, {} rotated dims, scaling {:?}",
        md.rope.theta, md.rope.style, md.rope.rotated_dims, md.rope.scaling
    );
    if !md.layers.is_empty() {
        let kinds: Vec<String> = md
            .layers
            .iter()
            .map(|la| match la.window {
                Some(w) => format!("sliding {w} (theta {})", la.rope_theta),
                None => format!("full (theta {})", la.rope_theta),
            })
            .collect();
        println!("layers     {}", kinds.join(", "));
    }
    println!(
        "tokens     {} prompt + {} generated ({}) = T {}",
        m.prompt_len(),
        m.generation.n_decode,
        m.generation.method,
        m.total_len()
    );
    let prompt: String = m.tokens.text[..m.prompt_len()].concat();
    let cont: String = m.tokens.text[m.prompt_len()..].concat();
    println!("prompt     {:?}", preview(&prompt, 160));
    println!("generated  {:?}", preview(&cont, 160));
    for s in &m.spans {
        println!("span       {} [{}, {})", s.name, s.start, s.end);
    }
    let c = &m.capture;
    println!(
        "capture    device {}, dtype {} (compute {}), chunk {}, threads {}, attn_probs {}, chat {}, source {}",
        c.device, c.dtype.name(), c.compute_dtype, c.prefill_chunk, c.threads, c.attn_probs, c.chat_template, c.prompt_source
    );
    println!(
        "created    {} by kvreplay {}",
        c.created, c.kvreplay_version
    );
    println!();
    println!(
        "layer  q {:?}  k/v {:?}  o {:?}  attn_colsum [{}, {}]",
        [md.n_heads, m.total_len(), md.head_dim],
        [md.n_kv_heads, m.total_len(), md.head_dim],
        [md.n_heads, m.total_len(), md.head_dim],
        md.n_heads,
        m.prompt_len()
    );
    println!(
        "{:>5} {:>9} {:>9} {:>9} {:>9}   (mean L2 norm of a row)",
        "layer", "|q|", "|k|", "|v|", "|o|"
    );
    for l in 0..trace.n_layers() {
        let layer = trace.layer(l);
        let norm = |views: Vec<kvreplay_traces::HeadView>| -> f64 {
            let (mut s, mut n) = (0f64, 0usize);
            for v in views {
                for row in v.to_f32().chunks_exact(v.cols) {
                    s += row.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                    n += 1;
                }
            }
            s / n as f64
        };
        println!(
            "{:>5} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
            l,
            norm((0..md.n_heads).map(|h| layer.q(h)).collect()),
            norm((0..md.n_kv_heads).map(|h| layer.k(h)).collect()),
            norm((0..md.n_kv_heads).map(|h| layer.v(h)).collect()),
            norm((0..md.n_heads).map(|h| layer.o(h)).collect()),
        );
    }
    Ok(())
}

fn preview(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "..."
    }
}
