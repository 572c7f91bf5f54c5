//! Which unit each parameter belongs to: FSDP2's `fully_shard(block)` calls, named by module
//! prefix (or by a function of the parameter's name), the rest belonging to the root.
use std::sync::Arc;

use crate::error::{FsdpError, Result};

/// A function from a parameter's name to its unit's name (`None`: the root).
pub type UnitOf = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The units a model is sharded by (PyTorch: the modules `fully_shard` is applied to before
/// the root).
#[derive(Clone)]
pub enum Units {
    /// One unit per module prefix: `"blocks.0"` holds `blocks.0.attn.weight` but not
    /// `blocks.01.weight`. A parameter matched by two prefixes is an error.
    Prefixes(Vec<String>),
    /// A function from a parameter's name to its unit's name, `None` for the root.
    ByName(UnitOf),
}

impl Units {
    pub fn prefixes<S: Into<String>>(prefixes: impl IntoIterator<Item = S>) -> Units {
        Units::Prefixes(prefixes.into_iter().map(Into::into).collect())
    }

    pub fn by_name(f: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Units {
        Units::ByName(Arc::new(f))
    }
}

impl Default for Units {
    /// No units: the whole model is one (the root).
    fn default() -> Self {
        Units::Prefixes(Vec::new())
    }
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Units::Prefixes(p) => f.debug_tuple("Prefixes").field(p).finish(),
            Units::ByName(_) => f.write_str("ByName(..)"),
        }
    }
}

/// The name the root unit goes by in messages.
pub(crate) const ROOT: &str = "<root>";

/// Parameters by unit: `names[u]` is unit `u`'s name, the root last; `of[p]` parameter `p`'s unit.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Assignment {
    pub names: Vec<String>,
    pub of: Vec<usize>,
}

fn under(name: &str, prefix: &str) -> bool {
    name == prefix || name.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.'))
}

/// Assigns every parameter in `params` to a unit; with `shard_root` false a parameter left to
/// the root is an error.
pub(crate) fn assign(params: &[&str], units: &Units, shard_root: bool) -> Result<Assignment> {
    let mut names: Vec<String> = Vec::new();
    let mut of = Vec::with_capacity(params.len());
    let mut unit_of_param: Vec<Option<usize>> = Vec::with_capacity(params.len());
    match units {
        Units::Prefixes(prefixes) => {
            names = prefixes.iter().map(|p| p.trim_end_matches('.').to_string()).collect();
            for p in params {
                let mut found: Option<usize> = None;
                for (u, prefix) in names.iter().enumerate() {
                    if !under(p, prefix) {
                        continue;
                    }
                    if let Some(first) = found {
                        return Err(FsdpError::OverlappingUnits {
                            param: p.to_string(),
                            first: names[first].clone(),
                            second: prefix.clone(),
                        });
                    }
                    found = Some(u);
                }
                unit_of_param.push(found);
            }
        }
        Units::ByName(f) => {
            for p in params {
                unit_of_param.push(f(p).map(|unit| {
                    names.iter().position(|n| *n == unit).unwrap_or_else(|| {
                        names.push(unit);
                        names.len() - 1
                    })
                }));
            }
        }
    }
    for (u, name) in names.iter().enumerate() {
        if !unit_of_param.contains(&Some(u)) {
            return Err(FsdpError::EmptyUnit { unit: name.clone() });
        }
        if name == ROOT {
            return Err(FsdpError::InvalidOption {
                what: "units",
                why: format!("`{ROOT}` is the root's name"),
            });
        }
    }
    let root = names.len();
    for (p, u) in params.iter().zip(&unit_of_param) {
        match u {
            Some(u) => of.push(*u),
            None if shard_root => of.push(root),
            None => return Err(FsdpError::Unassigned { param: p.to_string() }),
        }
    }
    names.push(ROOT.to_string());
    Ok(Assignment { names, of })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: [&str; 5] = [
        "wte.weight",
        "blocks.0.fc.weight",
        "blocks.1.fc.weight",
        "blocks.10.fc.weight",
        "ln_f.weight",
    ];

    #[test]
    fn prefixes_claim_whole_modules_and_the_rest_is_the_root() {
        let a = assign(&PARAMS, &Units::prefixes(["blocks.0", "blocks.1.", "blocks.10"]), true)
            .unwrap();
        assert_eq!(a.names, ["blocks.0", "blocks.1", "blocks.10", ROOT]);
        assert_eq!(a.of, [3, 0, 1, 2, 3]);
        let by_block = Units::by_name(|n| {
            n.strip_prefix("blocks.").map(|r| format!("block {}", r.split('.').next().unwrap()))
        });
        let b = assign(&PARAMS, &by_block, true).unwrap();
        assert_eq!(b.names, ["block 0", "block 1", "block 10", ROOT]);
        assert_eq!(b.of, a.of);
    }

    #[test]
    fn overlapping_units_empty_units_and_unassigned_parameters_are_named() {
        let e = assign(&PARAMS, &Units::prefixes(["blocks", "blocks.1"]), true).unwrap_err();
        assert_eq!(
            e.to_string(),
            "parameter `blocks.1.fc.weight` is in unit `blocks` and in unit `blocks.1`: units \
             must not overlap"
        );
        let e = assign(&PARAMS, &Units::prefixes(["block.0"]), true).unwrap_err();
        assert_eq!(e.to_string(), "unit `block.0` matches no parameter");
        let e = assign(&PARAMS, &Units::prefixes(["blocks"]), false).unwrap_err();
        assert!(e.to_string().starts_with("parameter `wte.weight` is in no unit"), "{e}");
    }
}
