//! ZeRO's per-rank optimizer entries through live regroups, on real process groups (threads over
//! loopback): the mirror ring, the re-split after a rank's death (its entries from the mirror,
//! the others kept or moved to their new owner) and entries nobody holds (fresh state).
use tandem_ckpt::{TensorData, Value};
use tandem_comm::ProcessGroup;
use tandem_state::live::{exchange_mirror, owned_by, regroup, Entries, RegroupCounts};
use tandem_testutil::run_tcp_world;

/// Parameter `i`'s momentum as of `step` (distinct for every parameter and step).
fn entry(i: usize, step: u64) -> Value {
    let v = [i as f32, step as f32, (i * 10) as f32 + step as f32 * 0.5];
    Value::dict_from([("momentum_buffer", Value::Tensor(TensorData::from_f32(&[3], &v)))])
}

fn entries(params: &[usize], step: u64) -> Entries {
    Entries { step, entries: params.iter().map(|&i| (i, entry(i, step))).collect() }
}

/// This rank's entries under the partition `owner`, from `own` and `mirror`; parameters nobody
/// holds start fresh.
fn regroup_entries(
    pg: &ProcessGroup,
    step: u64,
    own: &Entries,
    mirror: &Entries,
    owner: &[usize],
) -> (Vec<(usize, Value)>, RegroupCounts) {
    let want = |rank: usize| owned_by(owner, rank);
    let (mine, counts) =
        regroup(pg, step, owner.len(), Some(own), Some(mirror), &want, &mut |_| Ok(None)).unwrap();
    assert_eq!(mine.step, step);
    (mine.entries, counts)
}

/// Old world of 4: rank r owns parameters {r, r + 4}.
fn owned(r: usize) -> Vec<usize> {
    vec![r, r + 4]
}

#[test]
fn the_mirror_ring_gives_every_rank_its_predecessors_entries() {
    let got = run_tcp_world(3, |pg| {
        let own = entries(&owned(pg.rank()), 5);
        exchange_mirror(&pg, &own, 8).unwrap().unwrap()
    });
    for (r, m) in got.iter().enumerate() {
        assert_eq!(*m, entries(&owned((r + 2) % 3), 5), "rank {r}");
    }
}

#[test]
fn a_dead_ranks_entries_come_from_the_mirror_and_move_to_their_new_owners() {
    // Old rank 1 dies at step 20 (mirrors of step 15). Survivors 0, 2, 3 become 0, 1, 2; the new
    // partition: parameter i -> i % 3.
    let old = [0usize, 2, 3];
    let owner: Vec<usize> = (0..8).map(|i| i % 3).collect();
    let owner2 = owner.clone();
    let got = run_tcp_world(3, move |pg| {
        let was = old[pg.rank()];
        let own = entries(&owned(was), 20);
        let mirror = entries(&owned((was + 3) % 4), 15);
        regroup_entries(&pg, 20, &own, &mirror, &owner2)
    });
    for (r, (mine, counts)) in got.iter().enumerate() {
        let want: Vec<(usize, Value)> = (0..8)
            .filter(|i| owner[*i] == r)
            .map(|i| (i, entry(i, if owned(1).contains(&i) { 15 } else { 20 })))
            .collect();
        assert_eq!(*mine, want, "new rank {r}");
        assert_eq!(counts.from_mirror, 2);
        assert_eq!(counts.fresh, 0);
        assert_eq!(counts.kept + counts.moved + counts.from_mirror, 8);
        assert_eq!(counts.stale_steps, 2 * 5, "two parameters' state 5 steps old");
        assert!(counts.moved > 0 && counts.bytes_sent > 0, "{counts:?}");
    }
}

#[test]
fn entries_nobody_holds_start_fresh_and_are_counted() {
    // Old ranks 1 and 2 die together: old rank 1's entries were mirrored only on rank 2.
    let old = [0usize, 3];
    let owner: Vec<usize> = (0..8).map(|i| i % 2).collect();
    let owner2 = owner.clone();
    let got = run_tcp_world(2, move |pg| {
        let was = old[pg.rank()];
        let own = entries(&owned(was), 9);
        let mirror = entries(&owned((was + 3) % 4), 8);
        regroup_entries(&pg, 9, &own, &mirror, &owner2)
    });
    let lost = owned(1);
    for (r, (mine, counts)) in got.iter().enumerate() {
        let held: Vec<usize> = mine.iter().map(|(i, _)| *i).collect();
        let want: Vec<usize> = (0..8).filter(|i| owner[*i] == r && !lost.contains(i)).collect();
        assert_eq!(held, want, "new rank {r}: old rank 1's parameters have no entry");
        assert_eq!(counts.fresh, 2);
        assert_eq!(counts.from_mirror, 2);
    }
}
