//! The PartialFC head through live regroups, on real process groups (threads over loopback):
//! the buddy mirror's ring exchange, and the re-split after a rank's death (rows from their
//! owners, the dead rank's from its mirror), after two neighbours' deaths (the rows nobody
//! holds from the fallback), and after a replacement joins (it holds nothing and gets its rows;
//! the mirror right after it sends again only what the re-split did not already put in place).
use std::ops::Range;

use tandem_comm::ProcessGroup;
use tandem_partial_fc::ClassSplit;
use tandem_recipes::face::RowBlock;
use tandem_testutil::run_tcp_world;
use tandem_train::live::{exchange_mirror, regroup, Mirrored, RegroupCounts};
use tandem_train::Result;

const CLASSES: usize = 10;
const E: usize = 3;

/// Class `c`'s centre at `step` (different for every class, element and step) and momentum.
fn centre(c: usize, j: usize, step: u64) -> f32 {
    (c * 100 + j) as f32 + step as f32 * 0.001
}
fn momentum(c: usize, j: usize, step: u64) -> f32 {
    -centre(c, j, step)
}

fn block(classes: Range<usize>, step: u64) -> RowBlock {
    let w = classes.clone().flat_map(|c| (0..E).map(move |j| centre(c, j, step))).collect();
    let m = classes.clone().flat_map(|c| (0..E).map(move |j| momentum(c, j, step))).collect();
    RowBlock {
        start: classes.start,
        len: classes.len(),
        step,
        weight: w,
        state: vec![("momentum_buffer".into(), m)],
    }
}

fn shard(world: usize, rank: usize) -> Range<usize> {
    let s = ClassSplit::new(CLASSES, world, rank);
    s.start..s.start + s.len
}

/// What a rank of the new world must end with: each class's rows at the step `step_of` says.
fn expected(world: usize, rank: usize, step: u64, step_of: impl Fn(usize) -> u64) -> RowBlock {
    let r = shard(world, rank);
    let mut b = block(r.clone(), step);
    for (i, c) in r.enumerate() {
        for j in 0..E {
            b.weight[i * E + j] = centre(c, j, step_of(c));
            b.state[0].1[i * E + j] = momentum(c, j, step_of(c));
        }
    }
    b
}

fn no_fallback(r: Range<usize>) -> Result<RowBlock> {
    panic!("no rows should be missing, asked for {r:?}")
}

/// This rank's rows of the new world (`pg`), each rank wanting its class split; `fallback`
/// gives rows nobody holds.
fn regroup_rows(
    pg: &ProcessGroup,
    step: u64,
    own: Option<&RowBlock>,
    mirror: Option<&RowBlock>,
    fallback: &mut dyn FnMut(Range<usize>) -> Result<RowBlock>,
) -> (RowBlock, RegroupCounts) {
    let world = pg.size();
    let want = |rank: usize| vec![shard(world, rank)];
    let mut fill = |r: Range<usize>| Ok(Some(fallback(r)?));
    regroup(pg, step, CLASSES, own, mirror, &want, &mut fill).unwrap()
}

#[test]
fn the_mirror_ring_gives_every_rank_its_predecessors_rows() {
    for world in [2usize, 3, 4] {
        let got = run_tcp_world(world, move |pg| {
            let own = block(shard(world, pg.rank()), 7);
            exchange_mirror(&pg, &own, CLASSES).unwrap().unwrap()
        });
        for (r, m) in got.iter().enumerate() {
            let prev = (r + world - 1) % world;
            assert_eq!(*m, block(shard(world, prev), 7), "world {world}, rank {r}");
        }
    }
}

#[test]
fn a_dead_ranks_rows_come_from_its_mirror_and_the_rest_from_their_owners() {
    // Old world of 4 at step 7, mirrors taken at step 5; old rank 2 dies. The survivors (old
    // 0, 1, 3) are the new ranks 0, 1, 2; old rank 3 holds old rank 2's mirror.
    let old = [0usize, 1, 3];
    let got = run_tcp_world(3, move |pg| {
        let was = old[pg.rank()];
        let own = block(shard(4, was), 7);
        let mirror = block(shard(4, (was + 3) % 4), 5);
        regroup_rows(&pg, 7, Some(&own), Some(&mirror), &mut no_fallback)
    });
    let lost = shard(4, 2);
    for (r, (rows, _)) in got.iter().enumerate() {
        let step_of = |c: usize| if lost.contains(&c) { 5 } else { 7 };
        assert_eq!(*rows, expected(3, r, 7, step_of), "new rank {r}");
    }
    let counts: RegroupCounts = got[0].1;
    assert_eq!(got[1].1, counts, "every rank reports the world's counts");
    assert_eq!(counts.from_mirror, lost.len() as u64);
    assert_eq!(counts.reloaded, 0);
    assert_eq!(counts.kept + counts.moved + counts.from_mirror, CLASSES as u64);
    assert_eq!(counts.stale_steps, 2 * lost.len() as u64, "the mirror was 2 steps old");
    assert!(counts.moved > 0 && counts.bytes_sent > 0, "{counts:?}");
}

#[test]
fn rows_nobody_holds_come_from_the_fallback() {
    // Old ranks 1 and 2 of 4 die together: old rank 1's rows were mirrored on old rank 2 only.
    let old = [0usize, 3];
    let got = run_tcp_world(2, move |pg| {
        let was = old[pg.rank()];
        let own = block(shard(4, was), 9);
        let mirror = block(shard(4, (was + 3) % 4), 8);
        let mut asked = Vec::new();
        let mut fallback = |r: Range<usize>| {
            asked.push(r.clone());
            Ok(block(r, 4))
        };
        let out = regroup_rows(&pg, 9, Some(&own), Some(&mirror), &mut fallback);
        (out, asked)
    });
    let (lost1, lost2) = (shard(4, 1), shard(4, 2));
    for (r, ((rows, counts), _)) in got.iter().enumerate() {
        let step_of = |c: usize| match c {
            c if lost1.contains(&c) => 4,
            c if lost2.contains(&c) => 8,
            _ => 9,
        };
        assert_eq!(*rows, expected(2, r, 9, step_of), "new rank {r}");
        assert_eq!(counts.reloaded, lost1.len() as u64);
        assert_eq!(counts.from_mirror, lost2.len() as u64);
    }
    let asked: Vec<Range<usize>> = got.iter().flat_map(|(_, a)| a.clone()).collect();
    // Each new rank asks only for its own part of them (old rank 1's rows straddle the split).
    let (a, b) = (shard(2, 0), shard(2, 1));
    let want = vec![lost1.start..a.end.min(lost1.end), b.start.max(lost1.start)..lost1.end];
    assert_eq!(asked, want, "only the rows nobody holds are asked for, once, by their new owner");
}

#[test]
fn a_replacement_that_holds_nothing_gets_its_rows_from_the_others() {
    // World of 3 at step 12; a replacement joins as rank 3 with nothing (no optimizer state on
    // one survivor: its rows travel without, and arrive with zeros).
    let got = run_tcp_world(4, move |pg| {
        let r = pg.rank();
        let own = (r < 3).then(|| block(shard(3, r), 12));
        regroup_rows(&pg, 12, own.as_ref(), None, &mut no_fallback)
    });
    for (r, (rows, counts)) in got.iter().enumerate() {
        assert_eq!(*rows, expected(4, r, 12, |_| 12), "new rank {r}");
        assert_eq!(counts.kept + counts.moved, CLASSES as u64);
        assert_eq!(counts.stale_steps, 0);
    }
}

#[test]
fn a_block_without_optimizer_state_gives_zero_momentum() {
    let got = run_tcp_world(2, move |pg| {
        let mut own = block(shard(2, pg.rank()), 1);
        if pg.rank() == 1 {
            own.state.clear();
        }
        regroup_rows(&pg, 1, Some(&own), None, &mut no_fallback)
    });
    assert_eq!(got[0].0, expected(2, 0, 1, |_| 1), "rank 0 keeps its momentum");
    let rows = &got[1].0;
    assert_eq!(rows.state.len(), 1, "the world's state names: {:?}", rows.state);
    assert!(rows.state[0].1.iter().all(|&v| v == 0.0), "no state: zero momentum");
    assert_eq!(rows.weight, block(shard(2, 1), 1).weight);
}

/// A world regroups with `own[r]` held by rank `r` (the joiners none) and takes the mirror
/// right after it: every rank's mirror must be its predecessor's new rows, as a full exchange
/// gives; returns each rank's bytes sent by that mirror.
fn regroup_then_mirror(world: usize, own: fn(usize) -> Option<RowBlock>) -> Vec<u64> {
    let got = run_tcp_world(world, move |pg| {
        let mut live =
            Mirrored::<RowBlock>::new(10, own(pg.rank()).is_some()).keeping_what_it_sends();
        let want = |rank: usize| vec![shard(world, rank)];
        let mut fill = |r: Range<usize>| -> Result<Option<RowBlock>> { no_fallback(r).map(Some) };
        let mine = own(pg.rank());
        let (rows, _) = live.regroup(&pg, 12, CLASSES, mine.as_ref(), &want, &mut fill).unwrap();
        live.exchange_regrouped(&pg, &rows, CLASSES, std::time::Instant::now()).unwrap();
        // The same mirror the long way, for comparison.
        let full = exchange_mirror(&pg, &rows, CLASSES).unwrap().unwrap();
        (rows, live.mirror().cloned(), full, live.cost("head").bytes_per_rank)
    });
    for (r, (_, mirror, full, _)) in got.iter().enumerate() {
        let prev = (r + world - 1) % world;
        let want = expected(world, prev, 12, |_| 12);
        assert_eq!(mirror.as_ref(), Some(&want), "world {world}: rank {r}'s mirror");
        assert_eq!(*full, want, "world {world}: rank {r}'s full exchange");
    }
    got.into_iter().map(|(.., bytes)| bytes).collect()
}

#[test]
fn a_mirror_after_a_join_sends_only_what_the_resplit_did_not_move() {
    // A survivor alone with every row (step 12); one or two replacements join.
    let survivor = |r: usize| (r == 0).then(|| block(0..CLASSES, 12));
    let sent = regroup_then_mirror(2, survivor);
    // Rank 1 received all of its rows from rank 0, which holds its mirror: it sends nothing,
    // and rank 0 keeps what it sent as rank 1's mirror.
    assert_eq!(sent[1], 0, "the replacement sends its rows back: {sent:?}");
    assert!(sent[0] > 0, "the survivor's own rows must reach the replacement: {sent:?}");
    let sent = regroup_then_mirror(3, survivor);
    // Rank 2's rows all came from rank 0, its mirror's holder; rank 1's from rank 0 too, but
    // its mirror is rank 2's to hold: it sends them.
    assert_eq!(sent[2], 0, "{sent:?}");
    assert!(sent[0] > 0 && sent[1] > 0, "{sent:?}");
}

#[test]
fn a_mirror_after_a_mixed_resplit_sends_everything() {
    // Two holders (0..5 and 5..10) and a replacement: every rank's new rows mix sources, so
    // every rank sends its rows to its buddy.
    let sent = regroup_then_mirror(3, |r| (r < 2).then(|| block(shard(2, r), 12)));
    assert!(sent.iter().all(|&b| b > 0), "{sent:?}");
}
