//! The loop's record: what the [`Trainer`](super::Trainer) has done so far beyond the recipe's
//! state. Live recovery sends it whole with the state, so it is one serde struct, never copied
//! field by field.
use std::path::PathBuf;

use super::live::Regrouping;
use super::{Evaluation, StepTimes};
use crate::metrics::ValidationMetrics;
use crate::EpochMetrics;

/// The loop's record, which every rank takes from a regroup's source with the state. What is
/// done at this step — an epoch closed, a checkpoint written, the final validation and
/// evaluation — decides which collectives come next: a replacement that joins in the same
/// regroup as a failure (after the last step, say) must neither run what the others already
/// did nor skip what they will do, or the world calls different collectives. The figures make
/// its reports, should it become rank 0, the run's.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct LoopRecord {
    pub(crate) epoch_to_close: Option<(u64, f64)>,
    pub(crate) saved_at: Option<u64>,
    pub(crate) last_ckpt: Option<PathBuf>,
    pub(crate) verified_at: Option<u64>,
    pub(crate) last_val: Vec<ValidationMetrics>,
    pub(crate) last_eval: Option<Evaluation>,
    pub(crate) epochs_seen: Vec<EpochMetrics>,
    pub(crate) samples_seen: u64,
    pub(crate) train_time: f64,
    pub(crate) warm: Option<(f64, u64)>,
    pub(crate) times: StepTimes,
    pub(crate) regrouping: Option<Regrouping>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::{pop_record, push_record};

    #[test]
    fn the_loop_record_travels_behind_the_state_with_a_nan_loss() {
        let epoch = EpochMetrics {
            epoch: 2,
            step: 20,
            train_loss: f64::NAN,
            eval_loss: None,
            eval_accuracy: Some(0.5),
            verification: Vec::new(),
            samples_per_s: 100.0,
            lr: 0.1,
            loss_scale: Some(65536.0),
            skipped_steps: 1,
            at_unix_s: Some(1.8e9),
        };
        let val = ValidationMetrics::new("val", 0.99, 0.01).with("spread", 20.0);
        let record = LoopRecord {
            epoch_to_close: Some((2, f64::NAN)),
            saved_at: Some(20),
            last_ckpt: Some(PathBuf::from("runs/x/checkpoints/step-00000020")),
            verified_at: None,
            last_val: vec![val.clone()],
            last_eval: Some(Evaluation { loss: f64::INFINITY, accuracy: 0.5 }),
            epochs_seen: vec![epoch],
            samples_seen: 640,
            train_time: 1.5,
            warm: Some((0.25, 64)),
            times: StepTimes::default(),
            regrouping: Some(Regrouping {
                cause: "peer \"2\" died\nat once".into(),
                step_failed: true,
            }),
        };
        let mut bytes = b"the state".to_vec();
        push_record(&mut bytes, &record, "the loop's record").unwrap();
        let back: LoopRecord = pop_record(&mut bytes, "the loop's record").unwrap();
        assert_eq!(bytes, b"the state");
        assert!(back.epoch_to_close.is_some_and(|(e, l)| e == 2 && l.is_nan()));
        assert!(back.epochs_seen[0].train_loss.is_nan());
        assert_eq!(back.last_eval.map(|e| e.loss), Some(f64::INFINITY));
        assert_eq!(
            (back.saved_at, back.verified_at, back.warm),
            (Some(20), None, Some((0.25, 64)))
        );
        assert_eq!((back.last_val, back.last_ckpt), (vec![val], record.last_ckpt));
        let regrouping = back.regrouping.unwrap();
        assert_eq!(
            (regrouping.cause.as_str(), regrouping.step_failed),
            ("peer \"2\" died\nat once", true)
        );
        // A length that does not fit what came is an error naming the record, not a panic.
        for mut bad in [vec![1u8, 2, 3], [b"xx".as_slice(), &1000u64.to_le_bytes()].concat()] {
            let e = pop_record::<LoopRecord>(&mut bad, "the loop's record").err().unwrap();
            assert!(e.to_string().contains("the loop's record"), "{e}");
        }
    }
}
