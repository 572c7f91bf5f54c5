//! Slurm's job description as `srun` hands it to each task: the compressed host lists
//! (`SLURM_JOB_NODELIST=node[01-04,07],gpu5`, several bracket groups such as
//! `rack[1-2]-n[01-02]`), the per-node task counts (`SLURM_TASKS_PER_NODE=2(x3),1`) and a port
//! derived from `SLURM_JOB_ID`, so that two jobs sharing a node do not collide on 29500.
//!
//! Written here rather than taken from a crate: the only hostlist crates found parse a subset
//! (one bracket group, no padding rules) or pull in Slurm's C library; the grammar is small and
//! fully covered by the tests below.

/// Hosts of a Slurm host list in order: `node[01-03,07],gpu5` -> node01 node02 node03 node07
/// gpu5. Numbers keep their zero padding (`[08-10]` -> 08 09 10). An error names what does not
/// parse.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list.trim())? {
        if item.is_empty() {
            return Err(format!("empty host name in {list:?}"));
        }
        hosts.extend(expand_item(item)?);
    }
    if hosts.is_empty() {
        return Err("the host list is empty".into());
    }
    Ok(hosts)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut items) = (0i32, 0, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(format!("unbalanced or nested brackets in {list:?}"));
        }
    }
    if depth != 0 {
        return Err(format!("unclosed `[` in {list:?}"));
    }
    items.push(&list[start..]);
    Ok(items)
}

/// One host expression, possibly with several bracket groups: the cartesian product, the
/// leftmost group varying slowest (Slurm's order).
fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else { return Ok(vec![item.to_string()]) };
    let close =
        item[open..].find(']').map(|c| c + open).ok_or(format!("unclosed `[` in {item:?}"))?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_item(rest)?;
    let mut out = Vec::new();
    for range in ranges.split(',') {
        for number in expand_range(range).map_err(|e| format!("{item:?}: {e}"))? {
            for tail in &tails {
                out.push(format!("{prefix}{number}{tail}"));
            }
        }
    }
    Ok(out)
}

/// `07` -> [07]; `08-10` -> [08, 09, 10] (width of the first bound kept).
fn expand_range(range: &str) -> Result<Vec<String>, String> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
    if !digits(lo) || !digits(hi) {
        return Err(format!("`{range}` is not a number or a range of numbers"));
    }
    let (a, b): (u64, u64) =
        (lo.parse().map_err(|_| "too large")?, hi.parse().map_err(|_| "too large")?);
    if b < a {
        return Err(format!("range `{range}` runs backwards"));
    }
    if b - a > 1_000_000 {
        return Err(format!("range `{range}` is implausibly long"));
    }
    let width = lo.len();
    Ok((a..=b).map(|n| format!("{n:0width$}")).collect())
}

/// Tasks on each node from `SLURM_TASKS_PER_NODE`: `2(x3),1` -> [2, 2, 2, 1].
pub fn tasks_per_node(spec: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in spec.trim().split(',') {
        let bad = || format!("`{part}` in {spec:?} is not N or N(xM)");
        let (count, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let times: usize = times.parse().map_err(|_| bad())?;
        out.extend(std::iter::repeat_n(count, times));
    }
    Ok(out)
}

/// The store port of a Slurm job when MASTER_PORT is not set: 20000 + job id mod 20000, so
/// jobs sharing a node pick different ports (the same job always the same one).
pub fn port_for_job(job_id: u64) -> u16 {
    (20_000 + job_id % 20_000) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_nodelist(list).unwrap()
    }

    #[test]
    fn expands_the_forms_slurm_writes() {
        assert_eq!(hosts("node07"), ["node07"]);
        assert_eq!(hosts("node[01-04,07]"), ["node01", "node02", "node03", "node04", "node07"]);
        assert_eq!(hosts("gpu[08-10],cpu5"), ["gpu08", "gpu09", "gpu10", "cpu5"]);
        assert_eq!(hosts("a[1-2],b,c[9]"), ["a1", "a2", "b", "c9"]);
        assert_eq!(
            hosts("rack[1-2]-n[01-02]"),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(hosts("n[98-101]"), ["n98", "n99", "n100", "n101"]);
        assert_eq!(hosts(" x-1.cluster "), ["x-1.cluster"]);
    }

    #[test]
    fn bad_lists_are_named() {
        for (bad, what) in [
            ("node[01-04", "unclosed"),
            ("node[0a]", "`0a`"),
            ("node[5-3]", "backwards"),
            ("a,,b", "empty host"),
            ("n[[1]]", "nested"),
            ("", "empty host"),
        ] {
            let e = expand_nodelist(bad).unwrap_err();
            assert!(e.contains(what), "{bad:?}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_repeats() {
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(tasks_per_node("4").unwrap(), [4]);
        assert!(tasks_per_node("2(x").unwrap_err().contains("2(x"));
    }

    #[test]
    fn job_ports_are_in_range_and_differ() {
        assert_eq!(port_for_job(0), 20_000);
        assert_eq!(port_for_job(123_456), 23_456);
        assert_ne!(port_for_job(41), port_for_job(42));
        assert!((0..100_000).map(port_for_job).all(|p| (20_000..40_000).contains(&p)));
    }
}
