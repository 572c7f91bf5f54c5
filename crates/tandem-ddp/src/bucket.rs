//! Bucket assignment: which parameters share one flat all-reduce buffer. Like PyTorch's
//! `_compute_bucket_assignment_by_size`: walk parameters in the given order (reverse parameter
//! order at construction, gradient arrival order after the first iteration), close a bucket once
//! it holds at least its cap in bytes; the first bucket has its own (smaller) cap so the first
//! all-reduce starts early in backward. A single parameter larger than the cap gets a bucket of
//! its own.

/// One bucket: parameter indices (into the model's parameter list) in the order they are laid
/// out in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    pub params: Vec<usize>,
}

/// `order`: parameter indices in the order buckets should be filled; `numels[i]`: elements of
/// parameter i; caps in bytes (elements are f32, 4 bytes).
pub fn assign_buckets(
    order: &[usize],
    numels: &[usize],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<BucketPlan> {
    let mut plans = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0usize;
    for &p in order {
        current.push(p);
        bytes += numels[p] * 4;
        let cap = if plans.is_empty() { first_cap_bytes } else { cap_bytes };
        if bytes >= cap {
            plans.push(BucketPlan { params: std::mem::take(&mut current) });
            bytes = 0;
        }
    }
    if !current.is_empty() {
        plans.push(BucketPlan { params: current });
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_cap_gives_one_parameter_per_bucket() {
        let numels = [300, 400, 500];
        let plans = assign_buckets(&[2, 1, 0], &numels, 1000, 1000);
        assert_eq!(
            plans,
            vec![
                BucketPlan { params: vec![2] },
                BucketPlan { params: vec![1] },
                BucketPlan { params: vec![0] }
            ]
        );
    }

    #[test]
    fn large_cap_gives_one_bucket_and_first_cap_splits_early() {
        let numels = [1000, 10, 1000, 10];
        let one = assign_buckets(&[3, 2, 1, 0], &numels, 100 << 20, 100 << 20);
        assert_eq!(one, vec![BucketPlan { params: vec![3, 2, 1, 0] }]);
        // First cap 4000 bytes = 1000 f32: bucket 0 closes after params 3 and 2.
        let split = assign_buckets(&[3, 2, 1, 0], &numels, 4000, 100 << 20);
        assert_eq!(
            split,
            vec![BucketPlan { params: vec![3, 2] }, BucketPlan { params: vec![1, 0] }]
        );
    }
}
