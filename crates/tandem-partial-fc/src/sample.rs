//! Which centres take part in a step at `sample_rate < 1` (PartialFC's sparse update): every
//! positive centre (a class in the global batch held by this rank) plus random negatives, up to
//! `int(sample_rate * num_local)`, as a sorted index. The draw is arcface_torch's: a uniform
//! number per centre, positives forced to 2, the top `num_sample`, sorted; when the positives
//! alone exceed `num_sample`, the index is the positives.
//!
//! [`DrawAhead`] gives the same index as [`UniformNegatives`] with the expensive part off the
//! step's path: the draw does not depend on the batch, so a background thread draws step
//! `s + 1`'s numbers and selects their `num_sample` largest while step `s` trains; the step
//! then only leaves out its positives (the index is every positive plus the largest
//! non-positives, whatever the positives are) and merges two sorted lists.
use std::thread::JoinHandle;

use rand::{Rng, SeedableRng};

/// One step's question to a [`Sampler`].
#[derive(Debug)]
pub struct SampleRequest<'a> {
    pub rank: usize,
    pub step: u64,
    /// Centres this rank holds.
    pub num_local: usize,
    /// How many to keep (`int(sample_rate * num_local)`), at least the positives.
    pub num_sample: usize,
    /// The positive centres (local indices), sorted and unique; always kept.
    pub positives: &'a [usize],
}

/// Picks the centres of a step: `num_sample` sorted, unique local indices including every
/// positive. The default draws them at random ([`UniformNegatives`]); a closure can replay a
/// recorded choice.
pub trait Sampler: Send {
    fn sample(&mut self, req: &SampleRequest<'_>) -> Vec<usize>;
}

impl<F: FnMut(&SampleRequest<'_>) -> Vec<usize> + Send> Sampler for F {
    fn sample(&mut self, req: &SampleRequest<'_>) -> Vec<usize> {
        self(req)
    }
}

/// arcface_torch's draw, from a seed, the rank and the step (reproducible, and different on
/// every rank and step).
#[derive(Debug, Clone)]
pub struct UniformNegatives {
    pub seed: u64,
}

/// The draw of a step: one uniform number per centre, from the seed, the rank and the step.
fn draw(seed: u64, rank: usize, step: u64, num_local: usize) -> Vec<(f32, usize)> {
    let mix = seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.rotate_left(32);
    let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
    (0..num_local).map(|c| (rng.random::<f32>(), c)).collect()
}

/// Larger numbers first; ties (never between draws in practice) by index.
fn largest_first(a: &(f32, usize), b: &(f32, usize)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Moves the `k` largest of `draw` to its front: a selection in linear time, not a sort of
/// every centre (a million at arcface_torch's scale, ~80 ms a step); the order is total, so
/// the set is the one a sort would give.
fn select_largest(draw: &mut [(f32, usize)], k: usize) {
    if k > 0 && k < draw.len() {
        draw.select_nth_unstable_by(k - 1, largest_first);
    }
}

impl Sampler for UniformNegatives {
    fn sample(&mut self, req: &SampleRequest<'_>) -> Vec<usize> {
        let mut draw = draw(self.seed, req.rank, req.step, req.num_local);
        for &p in req.positives {
            draw[p].0 = 2.0;
        }
        let k = req.num_sample.min(draw.len());
        select_largest(&mut draw, k);
        let mut index: Vec<usize> = draw[..k].iter().map(|&(_, c)| c).collect();
        index.sort_unstable();
        index
    }
}

/// What the step needs of its draw, made ahead: its `num_sample` largest numbers' centres in
/// order of their numbers, largest first, and the same centres by index with their place in
/// that order.
struct Candidates {
    key: (usize, u64, usize, usize),
    by_number: Vec<usize>,
    by_index: Vec<(usize, u32)>,
}

impl Candidates {
    fn make(seed: u64, key: (usize, u64, usize, usize)) -> Self {
        let (rank, step, num_local, num_sample) = key;
        let mut draw = draw(seed, rank, step, num_local);
        let k = num_sample.min(num_local);
        select_largest(&mut draw, k);
        let mut top = draw;
        top.truncate(k);
        top.sort_unstable_by(largest_first);
        let by_number: Vec<usize> = top.iter().map(|&(_, c)| c).collect();
        let mut by_index: Vec<(usize, u32)> =
            by_number.iter().enumerate().map(|(place, &c)| (c, place as u32)).collect();
        by_index.sort_unstable();
        Candidates { key, by_number, by_index }
    }

    /// The index: every positive, and the largest non-positives up to `num_sample` in all. The
    /// candidates hold enough: at most `P` of the `num_sample` are positives, so at least
    /// `num_sample − P` are not.
    fn index(&self, positives: &[usize]) -> Vec<usize> {
        let is_positive = |c: &usize| positives.binary_search(c).is_ok();
        let wanted = self.by_number.len().saturating_sub(positives.len());
        // The place (in number order) of the last non-positive taken.
        let mut last = None;
        let mut taken = 0;
        for (place, c) in self.by_number.iter().enumerate() {
            if taken == wanted {
                break;
            }
            if !is_positive(c) {
                taken += 1;
                last = Some(place as u32);
            }
        }
        let chosen = self
            .by_index
            .iter()
            .filter(|(c, place)| last.is_some_and(|l| *place <= l) && !is_positive(c))
            .map(|&(c, _)| c);
        // Two sorted lists, merged.
        let mut index = Vec::with_capacity(self.by_number.len().max(positives.len()));
        let mut pos = positives.iter().copied().peekable();
        for c in chosen {
            while let Some(p) = pos.next_if(|&p| p < c) {
                index.push(p);
            }
            index.push(c);
        }
        index.extend(pos);
        index
    }
}

/// [`UniformNegatives`]' index, drawn a step ahead on a background thread (see the module
/// docs). A step whose draw was not made ahead (the first, or after the step count or the
/// class split changed) is drawn on the spot; the index is the same either way.
pub struct DrawAhead {
    seed: u64,
    next: Option<JoinHandle<Candidates>>,
}

impl DrawAhead {
    pub fn new(seed: u64) -> Self {
        DrawAhead { seed, next: None }
    }
}

impl std::fmt::Debug for DrawAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrawAhead").field("seed", &self.seed).finish_non_exhaustive()
    }
}

impl Sampler for DrawAhead {
    fn sample(&mut self, req: &SampleRequest<'_>) -> Vec<usize> {
        let key = (req.rank, req.step, req.num_local, req.num_sample);
        // The join waits for one bounded computation (a draw and a selection) started a step
        // ago. A thread that panicked (allocation failure) leaves nothing: draw on the spot.
        let ahead = self.next.take().and_then(|h| h.join().ok()).filter(|c| c.key == key);
        let seed = self.seed;
        let candidates = ahead.unwrap_or_else(|| Candidates::make(seed, key));
        let next = (req.rank, req.step + 1, req.num_local, req.num_sample);
        self.next = std::thread::Builder::new()
            .name("tandem-class-draw".into())
            .spawn(move || Candidates::make(seed, next))
            .ok();
        candidates.index(req.positives)
    }
}

/// Checks a sampler's answer: sorted, unique, in range, `num_sample` long, every positive in it.
pub(crate) fn check(index: &[usize], req: &SampleRequest<'_>) -> Result<(), String> {
    if index.len() != req.num_sample {
        return Err(format!(
            "the sampler returned {} centres, expected {}",
            index.len(),
            req.num_sample
        ));
    }
    if index.windows(2).any(|w| w[0] >= w[1]) {
        return Err("the sampler's index is not sorted and unique".into());
    }
    if let Some(bad) = index.iter().find(|&&c| c >= req.num_local) {
        return Err(format!(
            "the sampler returned centre {bad}, this rank holds {}",
            req.num_local
        ));
    }
    if let Some(p) = req.positives.iter().find(|p| index.binary_search(p).is_err()) {
        return Err(format!("the sampler left out positive centre {p}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selection gives the set a full sort of the draw gives (the earlier implementation),
    /// across sizes, sample counts and positives, ties included.
    #[test]
    fn selection_equals_sorting_every_centre() {
        fn by_sorting(req: &SampleRequest<'_>, seed: u64) -> Vec<usize> {
            let mix = seed
                ^ (req.rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ req.step.rotate_left(32);
            let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
            let mut draw: Vec<(f32, usize)> =
                (0..req.num_local).map(|c| (rng.random::<f32>(), c)).collect();
            for &p in req.positives {
                draw[p].0 = 2.0;
            }
            draw.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut index: Vec<usize> =
                draw.into_iter().take(req.num_sample).map(|(_, c)| c).collect();
            index.sort_unstable();
            index
        }
        for (num_local, num_sample, positives) in [
            (1, 1, vec![0]),
            (10, 10, vec![2]),
            (1000, 100, vec![5, 17, 999]),
            (5000, 1, vec![]),
            (5000, 4999, (0..300).collect()),
            (20_000, 2000, (0..2000).step_by(7).collect()),
        ] {
            for step in 0..3 {
                let req =
                    SampleRequest { rank: 1, step, num_local, num_sample, positives: &positives };
                let got = UniformNegatives { seed: 9 }.sample(&req);
                assert_eq!(got, by_sorting(&req, 9), "{num_local} centres, {num_sample} sampled");
                assert_eq!(check(&got, &req), Ok(()));
            }
        }
    }

    /// Drawn ahead or on the spot, the index is UniformNegatives' over a run of steps with
    /// changing positives (none, few, nearly all of the sample, all of it), a skipped step
    /// (drawn on the spot) and a world that changed size.
    #[test]
    fn drawing_ahead_gives_the_same_index() {
        let mut ahead = DrawAhead::new(3);
        let cases: [(u64, usize, usize, Vec<usize>); 7] = [
            (0, 5000, 500, vec![]),
            (1, 5000, 500, vec![3, 77, 4999]),
            (2, 5000, 500, (0..499).map(|i| i * 10).collect()),
            (3, 5000, 500, (0..500).map(|i| i * 7).collect()),
            (5, 5000, 500, vec![1, 2, 3]),
            (6, 3000, 300, vec![2999]),
            (7, 3000, 3000, vec![0, 5]),
        ];
        for (step, num_local, num_sample, positives) in &cases {
            let req = SampleRequest {
                rank: 2,
                step: *step,
                num_local: *num_local,
                num_sample: *num_sample,
                positives,
            };
            let got = ahead.sample(&req);
            assert_eq!(got, UniformNegatives { seed: 3 }.sample(&req), "step {step}");
            assert_eq!(check(&got, &req), Ok(()), "step {step}");
        }
    }

    #[test]
    fn keeps_every_positive_and_draws_the_rest_reproducibly() {
        let positives = [1, 7, 8];
        let req =
            SampleRequest { rank: 1, step: 3, num_local: 20, num_sample: 6, positives: &positives };
        let a = UniformNegatives { seed: 5 }.sample(&req);
        assert_eq!(check(&a, &req), Ok(()));
        assert_eq!(a, UniformNegatives { seed: 5 }.sample(&req));
        let other = SampleRequest { step: 4, ..req };
        assert_ne!(a, UniformNegatives { seed: 5 }.sample(&other), "a new draw each step");
        assert!(check(&[1, 7], &req).unwrap_err().contains("returned 2 centres"));
        assert!(check(&[0, 1, 2, 3, 7, 9], &req).unwrap_err().contains("positive centre 8"));
    }
}
