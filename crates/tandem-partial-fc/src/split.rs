//! Which class centres a rank holds: `C/W + (r < C%W)` of them, starting at
//! `C/W*r + min(r, C%W)` (arcface_torch's split: the first `C % W` ranks hold one more).

/// This rank's contiguous share of the classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassSplit {
    /// The first class this rank holds.
    pub start: usize,
    /// How many classes it holds (0 when there are fewer classes than ranks).
    pub len: usize,
    /// All classes.
    pub classes: usize,
}

impl ClassSplit {
    pub fn new(classes: usize, world: usize, rank: usize) -> ClassSplit {
        let (base, extra) = (classes / world, classes % world);
        ClassSplit {
            start: base * rank + rank.min(extra),
            len: base + usize::from(rank < extra),
            classes,
        }
    }

    /// The local index of global class `label`, if this rank holds it.
    pub fn local(&self, label: i64) -> Option<usize> {
        let l = usize::try_from(label).ok()?;
        (self.start..self.start + self.len).contains(&l).then(|| l - self.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_cover_every_class_once() {
        for (c, w) in [(10, 3), (10, 4), (3, 4), (1_000_000, 7), (7, 1)] {
            let splits: Vec<ClassSplit> = (0..w).map(|r| ClassSplit::new(c, w, r)).collect();
            let mut next = 0;
            for s in &splits {
                assert_eq!(s.start, next, "{c} over {w}");
                next += s.len;
            }
            assert_eq!(next, c);
            let (lo, hi) = (splits.iter().map(|s| s.len).min(), splits.iter().map(|s| s.len).max());
            assert!(hi.unwrap() - lo.unwrap() <= 1);
        }
        assert_eq!(ClassSplit::new(10, 3, 0), ClassSplit { start: 0, len: 4, classes: 10 });
        assert_eq!(ClassSplit::new(10, 3, 2), ClassSplit { start: 7, len: 3, classes: 10 });
        assert_eq!(ClassSplit::new(10, 3, 1).local(6), Some(2));
        assert_eq!(ClassSplit::new(10, 3, 1).local(7), None);
        assert_eq!(ClassSplit::new(10, 3, 1).local(-1), None);
    }
}
