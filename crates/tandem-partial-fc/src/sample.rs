//! Which centres take part in a step at `sample_rate < 1` (PartialFC's sparse update): every
//! positive centre (a class in the global batch held by this rank) plus random negatives, up to
//! `int(sample_rate * num_local)`, as a sorted index. The draw is arcface_torch's: a uniform
//! number per centre, positives forced to 2, the top `num_sample`, sorted; when the positives
//! alone exceed `num_sample`, the index is the positives.
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

impl Sampler for UniformNegatives {
    fn sample(&mut self, req: &SampleRequest<'_>) -> Vec<usize> {
        let mix = self.seed
            ^ (req.rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ req.step.rotate_left(32);
        let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
        let mut draw: Vec<(f32, usize)> =
            (0..req.num_local).map(|c| (rng.random::<f32>(), c)).collect();
        for &p in req.positives {
            draw[p].0 = 2.0;
        }
        // The `num_sample` largest (ties, never between draws in practice, by index): a
        // selection in linear time, not a sort of every centre (a million at arcface_torch's
        // scale, ~80 ms a step); the order is total, so the set is the one a sort would give.
        let largest_first =
            |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = req.num_sample.min(draw.len());
        if k > 0 && k < draw.len() {
            draw.select_nth_unstable_by(k - 1, largest_first);
        }
        let mut index: Vec<usize> = draw[..k].iter().map(|&(_, c)| c).collect();
        index.sort_unstable();
        index
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
