//! README's table of trace sizes is the output of `scripts/trace-sizes.sh`
//! (`kvreplay inspect --estimate`), not typed by hand; and the estimate is
//! what a capture writes.

use std::path::Path;
use std::process::Command;

mod common;

#[test]
fn readme_size_table_is_the_scripts_output() {
    let root = Path::new(common::ROOT);
    let o = Command::new(root.join("scripts/trace-sizes.sh"))
        .env("KVREPLAY_BIN", env!("CARGO_BIN_EXE_kvreplay"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::text(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let (a, b) = ("<!-- trace-sizes:begin -->\n", "<!-- trace-sizes:end -->");
    let start = readme.find(a).expect("README has the begin marker") + a.len();
    let end = readme.find(b).expect("README has the end marker");
    assert_eq!(
        &readme[start..end],
        table,
        "README's trace-size table is stale: paste the output of scripts/trace-sizes.sh"
    );
    // by hand: 32 layers x 32,784 positions x (32 q + 8 k + 8 v + 32 o heads)
    // x 128 dims x 2 bytes = 21.48e9, plus the f32 column sums 32 x 32 x
    // 32,768 x 4 = 0.13e9
    assert!(
        table.contains("| Llama-3.1-8B | 32 x 32/8 x 128 | 32768 | 21.6 GB |"),
        "{table}"
    );
}
