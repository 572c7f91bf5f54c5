//! The `Dataset` trait (map-style, like `torch.utils.data.Dataset`) and an in-memory dataset
//! of fixed-length f32 feature vectors with integer class labels.
use std::sync::Arc;

use crate::DataError;

/// One example: its feature vector (length `input_dim`) and class label.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub features: Vec<f32>,
    pub label: i64,
}

/// A map-style dataset for classification: `len` examples, each `input_dim` features and a label
/// in `0..num_classes`. `get` may be called from several loader workers at once.
pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;
    fn input_dim(&self) -> usize;
    fn num_classes(&self) -> usize;
    fn get(&self, index: usize) -> Result<Example, DataError>;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn input_dim(&self) -> usize {
        (**self).input_dim()
    }
    fn num_classes(&self) -> usize {
        (**self).num_classes()
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        (**self).get(index)
    }
}

/// Features stored row-major in one `Vec<f32>` (`len * input_dim`), labels alongside.
#[derive(Debug, Clone, PartialEq)]
pub struct InMemoryDataset {
    name: String,
    features: Vec<f32>,
    labels: Vec<i64>,
    input_dim: usize,
    num_classes: usize,
}

impl InMemoryDataset {
    /// Checks that `features` holds `labels.len()` rows of `input_dim` values and that every
    /// label lies in `0..num_classes`.
    pub fn new(
        name: impl Into<String>,
        features: Vec<f32>,
        labels: Vec<i64>,
        input_dim: usize,
        num_classes: usize,
    ) -> Result<Self, DataError> {
        if input_dim == 0 {
            return Err(DataError::ZeroArgument { what: "input_dim" });
        }
        if features.len() != labels.len() * input_dim {
            return Err(DataError::FeatureLength {
                index: features.len() / input_dim,
                got: features.len() % input_dim,
                expected: input_dim,
            });
        }
        if let Some((index, &label)) =
            labels.iter().enumerate().find(|(_, &l)| l < 0 || l as u64 >= num_classes as u64)
        {
            return Err(DataError::LabelOutOfRange { index, label, num_classes });
        }
        Ok(Self { name: name.into(), features, labels, input_dim, num_classes })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rows `indices`, in that order, as a new dataset (used for fixed train/eval splits).
    pub fn subset(&self, name: impl Into<String>, indices: &[usize]) -> Result<Self, DataError> {
        let mut features = Vec::with_capacity(indices.len() * self.input_dim);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            features.extend_from_slice(self.row(i)?);
            labels.push(self.labels[i]);
        }
        Self::new(name, features, labels, self.input_dim, self.num_classes)
    }

    /// Feature row `index` without copying.
    pub fn row(&self, index: usize) -> Result<&[f32], DataError> {
        if index >= self.labels.len() {
            return Err(DataError::IndexOutOfRange { index, len: self.labels.len() });
        }
        Ok(&self.features[index * self.input_dim..(index + 1) * self.input_dim])
    }

    pub fn labels(&self) -> &[i64] {
        &self.labels
    }
}

impl Dataset for InMemoryDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn input_dim(&self) -> usize {
        self.input_dim
    }
    fn num_classes(&self) -> usize {
        self.num_classes
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        Ok(Example { features: self.row(index)?.to_vec(), label: self.labels[index] })
    }
}
