//! AverageMeter, and metrics averaged across a real world of ranks (threads with loopback
//! sockets, bounded in time).
use tandem_ddp::metrics::{all_reduce_mean, AverageMeter};

#[test]
fn average_meter_accumulates_weighted_means() {
    let mut m = AverageMeter::new();
    m.update(2.0, 1);
    m.update(5.0, 3);
    assert_eq!((m.val, m.sum, m.count), (5.0, 17.0, 4.0));
    assert!((m.avg - 4.25).abs() < 1e-15);
    m.reset();
    assert_eq!(m, AverageMeter::default());
    m.update(1.5, 0);
    assert_eq!((m.val, m.avg, m.count), (1.5, 0.0, 0.0));
}

#[test]
fn metrics_are_averaged_across_ranks() {
    let results = tandem_testutil::run_tcp_world(3, |pg| {
        let rank = pg.rank() as f64;
        let mut values = [rank, 10.0 * rank + 1.0];
        all_reduce_mean(&pg, &mut values).unwrap();
        // Rank r saw r+1 samples of loss r: the global average weighs ranks by their counts.
        let mut meter = AverageMeter::new();
        meter.update(rank, pg.rank() + 1);
        let global = meter.all_reduce(&pg).unwrap();
        (values, global)
    });
    for (values, global) in results {
        assert_eq!(values, [1.0, 11.0]);
        assert_eq!((global.sum, global.count), (0.0 + 2.0 + 6.0, 6.0));
        assert!((global.avg - 8.0 / 6.0).abs() < 1e-15);
        assert!((global.val - 1.0).abs() < 1e-15);
    }
}
