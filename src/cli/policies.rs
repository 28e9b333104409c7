//! `kvreplay policies`: list every registered policy with its parameters.

use anyhow::Result;

pub(super) fn cmd_policies() -> Result<()> {
    for p in kvreplay_replay::REGISTRY {
        let kind = if p.wrapper {
            "  (wrapper: compose as POLICY+".to_string() + p.name + ")"
        } else {
            String::new()
        };
        println!("{}{}", p.name, kind);
        println!("    {}", p.summary);
        println!("    paper: {}", p.paper);
        for a in p.params {
            println!("    {:<15} default {:<9} {}", a.name, a.default, a.help);
        }
        println!();
    }
    println!("Spec syntax: NAME, NAME:key=value,key=value, or BASE+WRAPPER (e.g. snapkv:w=16+quant:bits=2).");
    Ok(())
}
