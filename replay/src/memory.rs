//! How much memory a replay may hold, and how much it held: the f32 layer
//! copies a [`TraceReplay`](crate::TraceReplay) keeps between points are
//! bounded by a cap (by default a share of the memory available to this
//! process), so a trace larger than memory streams a layer at a time.

/// Bytes this process could still allocate without swapping: the kernel's
/// `MemAvailable`, lowered to the room left under the memory limit of the
/// process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) when one
/// is set. None where neither can be read (not Linux).
pub fn available() -> Option<u64> {
    let avail = proc_kb("/proc/meminfo", "MemAvailable:")?;
    Some(match cgroup_room() {
        Some(room) => avail.min(room),
        None => avail,
    })
}

/// Limit minus usage of this process's memory cgroup, when it has a limit.
fn cgroup_room() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: String| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (limit, usage) = if controllers.is_empty() {
            // cgroup v2 ("max" does not parse: no limit)
            let base = format!("/sys/fs/cgroup{path}");
            (
                read(format!("{base}/memory.max")),
                read(format!("{base}/memory.current")),
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            let base = format!("/sys/fs/cgroup/memory{path}");
            (
                read(format!("{base}/memory.limit_in_bytes")),
                read(format!("{base}/memory.usage_in_bytes")),
            )
        } else {
            continue;
        };
        // v1 reports "no limit" as a huge number
        if let (Some(l), Some(u)) = (limit, usage) {
            if l < (1 << 60) {
                return Some(l.saturating_sub(u));
            }
        }
    }
    None
}

/// The default cap on the layer copies a replay keeps: half of what is
/// available when it starts (the rest is left to the page cache, the policy
/// state and other processes); unbounded where that cannot be read.
pub fn default_cap() -> u64 {
    available().map_or(u64::MAX, |a| a / 2)
}

/// Peak resident set of this process so far (`VmHWM`), in bytes.
pub fn peak_rss() -> Option<u64> {
    proc_kb("/proc/self/status", "VmHWM:")
}

/// The `KEY   N kB` line of a /proc file, in bytes.
fn proc_kb(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// "512M", "2G", "1.5G", "300000" (bytes) or "auto" (None).
pub fn parse_size(s: &str) -> Result<Option<u64>, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    let (num, mult) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = t[i..].to_ascii_uppercase();
            let m: u64 = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return Err(format!("`{s}`: unknown unit (use K, M, G or T, e.g. 512M)")),
            };
            (&t[..i], m)
        }
        None => (t, 1),
    };
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 512M, 2G or auto"))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(format!("`{s}`: the size must be positive"));
    }
    Ok(Some((x * mult as f64) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("512M"), Ok(Some(512 << 20)));
        assert_eq!(parse_size("1.5g"), Ok(Some(3 << 29)));
        assert_eq!(parse_size("2GiB"), Ok(Some(2 << 30)));
        assert_eq!(parse_size("4096"), Ok(Some(4096)));
        assert_eq!(parse_size("auto"), Ok(None));
        assert!(parse_size("12X").unwrap_err().contains("unknown unit"));
        assert!(parse_size("-1M").is_err() && parse_size("M").is_err());
    }
    #[test]
    fn this_process_reports_its_memory() {
        // Linux (where the tests run): both figures exist and are plausible
        let peak = peak_rss().expect("VmHWM in /proc/self/status");
        assert!(peak > 1 << 20, "{peak}");
        assert!(available().expect("MemAvailable") > 1 << 20);
    }
}
