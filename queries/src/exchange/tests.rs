use super::*;
use crate::target::fixtures;

fn ipu21() -> Target {
    Target::from_toml(fixtures::IPU21, "ipu21.toml").unwrap()
}

#[test]
fn seed_sized_report() {
    let target = ipu21();
    for (name, phase) in synthetic::seed_sized(target.chip.tiles) {
        let start = std::time::Instant::now();
        let schedule = schedule_phase(&target, &phase).unwrap();
        let elapsed = start.elapsed();
        let tables = lower_to_tables(&target, &phase, &schedule);
        validate(&target, &phase, &tables).unwrap();
        let elapsed_all = start.elapsed();
        eprintln!("with lowering and validation {elapsed_all:?}");
        eprintln!("{name}: bound {} horizon {} gap {:.2}% kind {} pieces {} in {:?}", schedule.endpoint_lower_bound, schedule.horizon, schedule.gap_percent(), schedule.kind.name(), schedule.pieces.len(), elapsed);
    }
}

#[test]
fn diagnose_gather() {
    let target = ipu21();
    let phase = synthetic::gemm_gather(target.chip.tiles, 15_064, 240, 420, 1);
    let problem = problem::prepare(&target, &phase).unwrap();
    let paired = vec![false; problem.jobs.len()];
    let pieces = greedy::full_duplex(&problem, &paired, 96, &[]);
    let n = problem.tiles as usize;
    let mut recv_busy = vec![0u64; n];
    let mut recv_first = vec![u32::MAX; n];
    let mut recv_last = vec![0u32; n];
    let mut send_busy = vec![0u64; n];
    let mut send_last = vec![0u32; n];
    for p in &pieces {
        let j = &problem.jobs[p.transfer as usize];
        send_busy[j.source as usize] += p.words as u64;
        send_last[j.source as usize] = send_last[j.source as usize].max(p.send_cycle + p.words);
        for port in problem.receive_ports(p.transfer as usize, false) {
            let d = port.tile as usize;
            recv_busy[d] += p.words as u64;
            recv_first[d] = recv_first[d].min(p.send_cycle + port.delay);
            recv_last[d] = recv_last[d].max(p.send_cycle + port.delay + p.words);
        }
    }
    let h = timing::horizon(&problem, &pieces);
    let mut late: Vec<usize> = (0..n).filter(|&d| recv_last[d] + 50 >= h).collect();
    late.sort_by_key(|&d| std::cmp::Reverse(recv_last[d]));
    eprintln!("horizon {h}, bound {}", bound::endpoint_bound(&problem));
    for &d in late.iter().take(10) {
        eprintln!("tile {d}: recv load {} first {} last {} idle {} | send load {} last {}", recv_busy[d], recv_first[d], recv_last[d], recv_last[d] as u64 - recv_first[d] as u64 - recv_busy[d], send_busy[d], send_last[d]);
    }
    let mut loads: Vec<u64> = recv_busy.clone();
    loads.sort();
    eprintln!("recv loads: max {} p99 {} p90 {} median {}", loads[n-1], loads[n*99/100], loads[n*9/10], loads[n/2]);
    let mut loads: Vec<u64> = send_busy.clone();
    loads.sort();
    eprintln!("send loads: max {} p99 {} p90 {} median {}", loads[n-1], loads[n*99/100], loads[n*9/10], loads[n/2]);
}

#[test]
fn profile_matching_large() {
    let target = ipu21();
    let phase = synthetic::mixed_large(target.chip.tiles, 84_859, 60, 300, 4_440, 6);
    let problem = problem::prepare(&target, &phase).unwrap();
    let start = std::time::Instant::now();
    let pieces = matching::matching_waves(&problem).unwrap();
    eprintln!("matching {} pieces in {:?}", pieces.len(), start.elapsed());
}

#[test]
fn profile_greedy_large() {
    let target = ipu21();
    let phase = synthetic::mixed_large(target.chip.tiles, 84_859, 60, 300, 4_440, 6);
    let problem = problem::prepare(&target, &phase).unwrap();
    for chunk in [96, 256] {
        let start = std::time::Instant::now();
        let paired = greedy::choose_pairing(&problem, greedy::Pairing::Ordinary);
        let pieces = greedy::full_duplex(&problem, &paired, chunk, &[]);
        eprintln!("greedy {chunk}: {} pieces horizon {} in {:?}", pieces.len(), timing::horizon(&problem, &pieces), start.elapsed());
    }
}
