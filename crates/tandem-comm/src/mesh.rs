//! `DeviceMesh` (PyTorch's `init_device_mesh`): the group's ranks laid out row-major on an
//! n-dimensional grid, with one subgroup per dimension — the ranks that differ only in that
//! coordinate. On a 2-D mesh named ("replicate", "shard") this is HSDP's layout: rows shard,
//! columns replicate. Every subgroup comes from the parent group's one store.
use crate::error::CommError;
use crate::group::ProcessGroup;

/// This rank's view of a mesh: its coordinate and its group along every dimension.
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    names: Vec<String>,
    coordinate: Vec<usize>,
    groups: Vec<ProcessGroup>,
}

/// Ranks of the mesh of `shape` whose coordinates equal `coord` except along `dim`.
fn line(shape: &[usize], dim: usize, coord: &[usize]) -> Vec<usize> {
    (0..shape[dim])
        .map(|k| {
            shape
                .iter()
                .enumerate()
                .fold(0, |rank, (d, &size)| rank * size + if d == dim { k } else { coord[d] })
        })
        .collect()
}

/// Coordinate of `rank` on a row-major mesh of `shape`.
fn coordinate_of(shape: &[usize], mut rank: usize) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        c[d] = rank % shape[d];
        rank /= shape[d];
    }
    c
}

impl DeviceMesh {
    /// Lays `group` out on `shape` (whose product must be the group's size) and builds one
    /// subgroup per dimension. `names`, if given, name the dimensions (PyTorch's
    /// `mesh_dim_names`). A collective call: every rank of `group` makes it.
    pub fn new(
        group: &ProcessGroup,
        shape: &[usize],
        names: Option<&[&str]>,
    ) -> Result<DeviceMesh, CommError> {
        let n = group.size();
        if shape.is_empty() || shape.contains(&0) || shape.iter().product::<usize>() != n {
            return Err(CommError::invalid(
                "init_device_mesh",
                format!("mesh shape {shape:?} does not hold the group's {n} ranks"),
            ));
        }
        let names: Vec<String> = match names {
            Some(names) if names.len() != shape.len() => {
                return Err(CommError::invalid(
                    "init_device_mesh",
                    format!(
                        "{} dimension names for a {}-dimensional mesh",
                        names.len(),
                        shape.len()
                    ),
                ))
            }
            Some(names) => {
                let mut sorted = names.to_vec();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != names.len() {
                    return Err(CommError::invalid(
                        "init_device_mesh",
                        format!("dimension names {names:?} repeat a name"),
                    ));
                }
                names.iter().map(|s| s.to_string()).collect()
            }
            None => (0..shape.len()).map(|d| format!("dim{d}")).collect(),
        };
        let coordinate = coordinate_of(shape, group.rank());
        let mut groups = Vec::with_capacity(shape.len());
        for dim in 0..shape.len() {
            // Every line along `dim`: one per coordinate of the other dimensions.
            let lines: Vec<Vec<usize>> = (0..n)
                .map(|r| coordinate_of(shape, r))
                .filter(|c| c[dim] == 0)
                .map(|c| line(shape, dim, &c))
                .collect();
            let mine = group.new_subgroups_by_enumeration(&lines)?;
            groups.push(mine.ok_or_else(|| CommError::Internal {
                op: "init_device_mesh",
                reason: format!("rank {} is on no line of dimension {dim}", group.rank()),
            })?);
        }
        Ok(DeviceMesh { shape: shape.to_vec(), names, coordinate, groups })
    }

    /// The mesh's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The dimensions' names.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }
    /// This rank's coordinate (PyTorch's `get_coordinate`).
    pub fn coordinate(&self) -> &[usize] {
        &self.coordinate
    }
    /// This rank's group along `dim` (PyTorch's `get_group(mesh_dim)`).
    pub fn group(&self, dim: usize) -> Result<&ProcessGroup, CommError> {
        self.groups.get(dim).ok_or_else(|| {
            CommError::invalid(
                "get_group",
                format!("dimension {dim} of a {}-dimensional mesh", self.shape.len()),
            )
        })
    }
    /// This rank's group along the dimension called `name`.
    pub fn group_named(&self, name: &str) -> Result<&ProcessGroup, CommError> {
        let dim = self.names.iter().position(|n| n == name).ok_or_else(|| {
            CommError::invalid(
                "get_group",
                format!("no dimension {name:?} (the mesh has {:?})", self.names),
            )
        })?;
        self.group(dim)
    }
    /// This rank's index along `dim` (PyTorch's `get_local_rank(mesh_dim)`).
    pub fn local_rank(&self, dim: usize) -> Result<usize, CommError> {
        self.group(dim).map(|g| g.rank())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_follow_pytorchs_row_major_layout() {
        // 2 x 3: [[0, 1, 2], [3, 4, 5]]
        assert_eq!(coordinate_of(&[2, 3], 4), vec![1, 1]);
        assert_eq!(line(&[2, 3], 0, &[0, 2]), vec![2, 5]);
        assert_eq!(line(&[2, 3], 1, &[1, 0]), vec![3, 4, 5]);
        // 2 x 2 x 2: the ranks differing in the middle coordinate from rank 5 = (1, 0, 1).
        assert_eq!(line(&[2, 2, 2], 1, &coordinate_of(&[2, 2, 2], 5)), vec![5, 7]);
    }
}
