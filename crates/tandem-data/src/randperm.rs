//! `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` reproduced bit for bit.
//!
//! Written here rather than taken from a crate because the point is PyTorch's exact order: its
//! CPU kernel seeds MT19937 with the low 32 bits of the seed and has two paths —
//! * `n < u32::MAX / 20`: forward Fisher–Yates, `z = random() % (n - i)`, swap(i, i + z), for
//!   `i` in `0..n-1`, with 32-bit draws;
//! * larger `n`: the "inside-out" Fisher–Yates with 64-bit draws (`(hi << 32) | lo` of two
//!   32-bit outputs), `z = random64() % (i + 1)`, so the modulo bias stays negligible.
//!
//! Both are checked against real torch output (tests/fixtures, and the ignored large-n test).
use rand_mt::Mt;

/// Sizes from this one up take PyTorch's 64-bit inside-out path.
pub const LARGE_N_THRESHOLD: usize = (u32::MAX / 20) as usize;

/// The permutation `torch.randperm(n, generator=g)` returns after `g.manual_seed(seed)`.
pub fn torch_randperm(n: usize, seed: u64) -> Vec<usize> {
    // at::mt19937 keeps only the low 32 bits of the seed.
    let mut mt = Mt::new(seed as u32);
    if n < LARGE_N_THRESHOLD {
        let mut perm: Vec<usize> = (0..n).collect();
        for i in 0..n.saturating_sub(1) {
            let z = mt.next_u32() as usize % (n - i);
            perm.swap(i, i + z);
        }
        perm
    } else {
        let mut perm = vec![0usize; n];
        for i in 0..n {
            // rand_mt's next_u64 is (first << 32) | second, as torch's random64().
            let z = (mt.next_u64() % (i as u64 + 1)) as usize;
            perm[i] = perm[z];
            perm[z] = i;
        }
        perm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_permutation() {
        for n in [0, 1, 2, 3, 17, 1000] {
            let mut p = torch_randperm(n, 7);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn seed_only_low_32_bits_matter() {
        assert_eq!(torch_randperm(50, 3), torch_randperm(50, 3 + (1u64 << 32)));
        assert_ne!(torch_randperm(50, 3), torch_randperm(50, 4));
    }
}
