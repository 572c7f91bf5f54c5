//! The live world's membership protocol inside one process: members are threads, each with
//! its own store connection (a member "dies" by dropping its LiveGroup: its store connection
//! and sockets close, as a killed process's would). Covered: the first generation, a lost
//! member, two lost at once, a replacement joining, a stalled member left out and let back
//! in, a proposer that dies while proposing, and the minimum world size. Bounded in time.
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tandem_comm::live::is_peer_failure;
use tandem_comm::{
    CommError, InitOptions, LiveGroup, LiveOptions, LiveStoreAt, ReduceOp, Store, StoreServer,
    TransportKind,
};

const RUN: &str = "live-test";

fn server() -> (StoreServer, String) {
    let s = StoreServer::bind("127.0.0.1:0", RUN, None).expect("bind store");
    let addr = s.local_addr().to_string();
    (s, addr)
}

fn options(addr: &str, member: usize, slots: usize) -> LiveOptions {
    LiveOptions {
        store: LiveStoreAt::Launcher(addr.to_string()),
        member,
        slots,
        min_world: 1,
        replacement: false,
        arrival_timeout: Duration::from_secs(2),
        init: InitOptions {
            // Sockets: a dropped thread-member closes them, as a dead process would.
            transport: Some(TransportKind::Tcp),
            timeout: Duration::from_secs(5),
            init_timeout: Duration::from_secs(10),
            run_id: RUN.to_string(),
            ..InitOptions::default()
        },
    }
}

/// The sum of every member slot (+1) over the current generation: who is in it.
fn members_sum(live: &LiveGroup) -> Result<f32, CommError> {
    let mut v = [live.member() as f32 + 1.0];
    live.group().all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[0])
}

/// Runs `f(member)` on `n` threads joined to one live world; returns their results.
fn world<T: Send + 'static>(
    addr: &str,
    n: usize,
    f: impl Fn(LiveGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|m| {
            let (f, o) = (Arc::clone(&f), options(addr, m, n));
            std::thread::spawn(move || f(LiveGroup::join(o).expect("join")))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("member thread")).collect()
}

#[test]
fn first_generation_holds_every_slot_in_order() {
    let (_s, addr) = server();
    let out = world(&addr, 3, |live| {
        let gen = live.generation();
        (gen.number, gen.members.clone(), gen.group.rank(), members_sum(&live).unwrap())
    });
    for (m, (number, members, rank, sum)) in out.into_iter().enumerate() {
        assert_eq!((number, members, rank, sum), (1, vec![0, 1, 2], m, 6.0));
    }
}

#[test]
fn survivors_of_a_lost_member_regroup_and_the_furthest_one_is_the_source() {
    let (_s, addr) = server();
    let started = Instant::now();
    let out = world(&addr, 4, |live| {
        members_sum(&live).unwrap();
        if live.member() == 2 {
            return None; // dies: its LiveGroup (store connection, sockets) is dropped
        }
        let e = members_sum(&live).expect_err("member 2 is gone");
        assert!(is_peer_failure(&e), "{e}");
        // Member 3 got one step further before the failure: its state wins.
        let progress = if live.member() == 3 { 11 } else { 10 };
        let gen = live.regroup(progress).unwrap();
        Some((
            gen.number,
            gen.members.clone(),
            gen.members[gen.source],
            members_sum(&live).unwrap(),
        ))
    });
    for r in out.into_iter().flatten() {
        assert_eq!(r, (2, vec![0, 1, 3], 3, 1.0 + 2.0 + 4.0));
    }
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

#[test]
fn two_members_lost_at_once_end_in_one_agreed_generation() {
    let (_s, addr) = server();
    let out = world(&addr, 5, |live| {
        members_sum(&live).unwrap();
        if [1, 3].contains(&live.member()) {
            return None;
        }
        let _ = members_sum(&live);
        let gen = live.regroup(5).unwrap();
        Some((gen.members.clone(), members_sum(&live).unwrap()))
    });
    for r in out.into_iter().flatten() {
        assert_eq!(r, (vec![0, 2, 4], 1.0 + 3.0 + 5.0));
    }
}

#[test]
fn a_replacement_joins_at_the_next_boundary_and_gets_the_running_state_source() {
    let (_s, addr) = server();
    let barrier = Arc::new(Barrier::new(3));
    let addr2 = addr.clone();
    let b = Arc::clone(&barrier);
    let out = world(&addr, 3, move |live| {
        members_sum(&live).unwrap();
        if live.member() == 1 {
            b.wait(); // the others have seen the failure...
            return None;
        }
        b.wait();
        let _ = members_sum(&live);
        let gen = live.regroup(7).unwrap();
        assert_eq!(gen.members, vec![0, 2]);
        if live.member() == 0 {
            // ...then a replacement for member 1 starts.
            let mut o = options(&addr2, 1, 3);
            o.replacement = true;
            std::thread::spawn(move || {
                let live = LiveGroup::join(o).expect("replacement joins");
                let gen = live.generation();
                (gen.members.clone(), gen.members[gen.source], members_sum(&live).unwrap())
            });
        }
        // Steps of the running world: a boundary check each.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut step = 7;
        loop {
            assert!(Instant::now() < deadline, "the replacement never joined");
            if live.regroup_wanted().unwrap() {
                break;
            }
            members_sum(&live).unwrap();
            step += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let gen = live.regroup(step).unwrap();
        Some((gen.members.clone(), members_sum(&live).unwrap()))
    });
    for r in out.into_iter().flatten() {
        assert_eq!(r, (vec![0, 1, 2], 6.0));
    }
}

#[test]
fn a_stalled_member_is_left_out_after_the_arrival_timeout_and_comes_back_as_a_joiner() {
    let (_s, addr) = server();
    let out = world(&addr, 3, |live| {
        members_sum(&live).unwrap();
        if live.member() == 2 {
            // Alive (its store key stays) but silent longer than the arrival timeout.
            std::thread::sleep(Duration::from_secs(3));
            let e = members_sum(&live).expect_err("its generation was left");
            assert!(is_peer_failure(&e), "{e}");
            let gen = live.regroup(1).unwrap();
            return (gen.members.clone(), members_sum(&live).unwrap());
        }
        let t = Instant::now();
        let _ = live.regroup(1).unwrap();
        let first = live.generation();
        assert_eq!(first.members, vec![0, 1], "member 2 left out");
        assert!(t.elapsed() >= Duration::from_millis(1900), "waited {:?}", t.elapsed());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !live.regroup_wanted().unwrap() {
            assert!(Instant::now() < deadline, "member 2 never asked to come back");
            members_sum(&live).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        let gen = live.regroup(2).unwrap();
        (gen.members.clone(), members_sum(&live).unwrap())
    });
    for r in out {
        assert_eq!(r, (vec![0, 1, 2], 6.0));
    }
}

#[test]
fn a_proposer_that_dies_while_proposing_is_replaced() {
    let (_s, addr) = server();
    // Member 0 dies; then an impostor connection takes slot 0 of generation 2 (alive and
    // ready, so it is the proposer) and dies without proposing. Members 1 and 2 start their
    // regroup only once the impostor is in place.
    let in_place = Arc::new(Barrier::new(3));
    let out = world(&addr, 3, {
        let addr = addr.clone();
        move |live| {
            members_sum(&live).unwrap();
            if live.member() == 0 {
                drop(live);
                let store = Store::connect(&addr, RUN, None, Duration::from_secs(5), "test")
                    .unwrap()
                    .with_prefix("live");
                store.set_owned("alive/0", b"holder impostor").unwrap();
                store.set("g2/ready/0", b"99").unwrap();
                in_place.wait();
                std::thread::sleep(Duration::from_millis(500));
                return None; // the connection closes: alive/0 goes away
            }
            in_place.wait();
            let _ = members_sum(&live);
            let t = Instant::now();
            let gen = live.regroup(3).unwrap();
            // It waited for the impostor to go, not for a timeout.
            assert!(t.elapsed() < Duration::from_millis(1900), "{:?}", t.elapsed());
            Some((gen.members.clone(), members_sum(&live).unwrap()))
        }
    });
    for r in out.into_iter().flatten() {
        assert_eq!(r, (vec![1, 2], 5.0));
    }
}

#[test]
fn below_the_minimum_every_survivor_gets_the_same_error() {
    let (_s, addr) = server();
    let handles: Vec<_> = (0..3)
        .map(|m| {
            let mut o = options(&addr, m, 3);
            o.min_world = 2;
            std::thread::spawn(move || {
                let live = LiveGroup::join(o).unwrap();
                members_sum(&live).unwrap();
                if live.member() != 0 {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(200));
                Some(live.regroup(4).expect_err("one rank is below the minimum").to_string())
            })
        })
        .collect();
    let errors: Vec<String> = handles.into_iter().filter_map(|h| h.join().unwrap()).collect();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].contains("only 1 rank(s) are left") && errors[0].contains("at least 2"),
        "{}",
        errors[0]
    );
}

#[test]
fn a_newcomer_whose_request_a_commit_without_it_counted_asks_again() {
    // CI once lost a replacement this way: its request reached the store just before the
    // survivors committed a generation without it, was counted in that commit's `wanted`, and
    // the running world never came back for it. Here the running world is member 0 alone,
    // played by hand, whose generation 2 has already counted the newcomer's first request.
    let (_s, addr) = server();
    let running = Store::connect(&addr, RUN, None, Duration::from_secs(5), "test")
        .unwrap()
        .with_prefix("live");
    running.set_owned("alive/0", b"holder pid 0 on test").unwrap();
    running.add("wanted", 1).unwrap();
    running.set("g2/members", b"members=0 source=0 progress=5 wanted=2").unwrap();
    running.set("committed", b"2").unwrap();

    let mut o = options(&addr, 1, 2);
    o.replacement = true;
    o.arrival_timeout = Duration::from_millis(300);
    let joiner = std::thread::spawn(move || {
        LiveGroup::join(o).map(|live| {
            let gen = live.generation();
            (gen.number, gen.members.clone(), gen.restart.clone())
        })
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    // Its first request (2) is the counted one; the running world sees only a later one.
    while running.add("wanted", 0).unwrap() <= 2 {
        assert!(Instant::now() < deadline, "the newcomer never asked again");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(running.get_now("g3/ready/1").unwrap().as_deref(), Some(&b"joiner"[..]));
    // The running world goes away with the state: the newcomer does not wait for it for ever
    // but starts the job again, alone, in a restart generation naming the member that died.
    drop(running);
    let gen = joiner.join().unwrap().expect("a restart generation");
    assert_eq!((gen.0, gen.1.as_slice(), gen.2.as_deref()), (3, &[1][..], Some(&[0][..])));
}

#[test]
fn when_every_member_died_the_replacements_form_a_restart_generation_together() {
    // Generation 1 of slots 0 and 1 is committed, then both die (their alive keys go): their
    // replacements, which hold no state, agree on generation 2 with both slots, marked a
    // restart of the members that died, once both are ready (not one alone first).
    let (_s, addr) = server();
    let dead = Store::connect(&addr, RUN, None, Duration::from_secs(5), "test")
        .unwrap()
        .with_prefix("live");
    dead.set("g1/members", b"members=0,1 source=0 progress=0,0 wanted=0").unwrap();
    dead.set("committed", b"1").unwrap();
    let joiners: Vec<_> = (0..2)
        .map(|m| {
            let mut o = options(&addr, m, 2);
            o.replacement = true;
            o.arrival_timeout = Duration::from_secs(5);
            std::thread::spawn(move || {
                // Member 1 comes a moment later: the restart waits for every slot.
                std::thread::sleep(Duration::from_millis(300 * m as u64));
                let live = LiveGroup::join(o).map_err(|e| e.to_string())?;
                let gen = live.generation();
                let sum = members_sum(&live).map_err(|e| e.to_string())?;
                Ok::<_, String>((gen.number, gen.members.clone(), gen.restart.clone(), sum))
            })
        })
        .collect();
    for j in joiners {
        let (number, members, restart, sum) = j.join().unwrap().unwrap();
        assert_eq!((number, members, restart, sum), (2, vec![0, 1], Some(vec![0, 1]), 3.0));
    }
}

#[test]
fn a_replacement_arriving_after_the_job_finished_is_told_it_is_over() {
    // The members finished (generation 1) and marked the job over; then one of them is
    // "replaced" (its launcher did not see the end): it must not start the job again.
    let (_s, addr) = server();
    world(&addr, 2, |live| live.finish().unwrap());
    let mut o = options(&addr, 1, 2);
    o.replacement = true;
    o.arrival_timeout = Duration::from_millis(300);
    let started = Instant::now();
    let e = LiveGroup::join(o).expect_err("the job is over").to_string();
    assert!(e.contains("the job is over") && e.contains("generation 1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}
