//! The probe's own peak memory, as the kernel counts it: `VmHWM` ("high water mark" of the
//! resident set) from `/proc/self/status`. The allgather reports it in its JSON
//! (`peak_rss_bytes`), so the memory a check needs is measured by every run, not assumed: the
//! DaemonSet's memory limit is derived from it (docs/kubernetes.md).

/// Peak resident set size of this process in bytes; `None` where `/proc` does not say (not
/// Linux, or no procfs).
pub fn peak_rss_bytes() -> Option<u64> {
    parse_vm_hwm(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// The `VmHWM:   12345 kB` line of a `/proc/<pid>/status` document, in bytes.
pub fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut words = line["VmHWM:".len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark() {
        let s = "Name:\tprobe\nVmPeak:\t  10000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(parse_vm_hwm(s), Some(2048 * 1024));
        assert_eq!(parse_vm_hwm("VmRSS:\t 1 kB\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\t lots kB\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\t 12 MB\n"), None);
    }

    #[test]
    fn this_process_has_one_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().is_some_and(|b| b > 0));
        }
    }
}
