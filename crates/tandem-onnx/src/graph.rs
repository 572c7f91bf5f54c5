//! Building an ONNX graph node by node: declared inputs and outputs, weights as initializers
//! named by their state-dict keys (as `torch.onnx.export` names them), nodes whose outputs get
//! fresh names.
use crate::proto::{
    attribute_type, AttributeProto, Dimension, DimensionValue, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, StringStringEntryProto, TensorProto, TensorShapeProto, TensorTypeProto,
    TypeProto, ValueInfoProto, FLOAT,
};

/// The IR version of the files written (ONNX 1.10+, onnxruntime 1.10+ read it).
pub const IR_VERSION: i64 = 8;
/// The `ai.onnx` operator set the graphs use (LayerNormalization, for the ViTs, needs 17).
pub const OPSET: i64 = 17;

/// One dimension of a declared input or output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Dim {
    Fixed(usize),
    /// A size chosen at run time, such as the batch.
    Named(&'static str),
}

pub struct GraphBuilder {
    graph: GraphProto,
    nodes_made: usize,
}

impl GraphBuilder {
    pub fn new(name: &str) -> Self {
        GraphBuilder {
            graph: GraphProto { name: name.into(), ..Default::default() },
            nodes_made: 0,
        }
    }

    /// Declares a float input of the graph.
    pub fn input(&mut self, name: &str, dims: &[Dim]) -> String {
        self.graph.input.push(value_info(name, dims));
        name.to_string()
    }

    /// Declares `value` (a node's output) as a float output of the graph under `name`.
    pub fn output(&mut self, value: &str, name: &str, dims: &[Dim]) {
        if value != name {
            self.node_into("Identity", &[value], vec![], name);
        }
        self.graph.output.push(value_info(name, dims));
    }

    /// A float constant (a weight), stored little-endian.
    pub fn initializer(&mut self, name: &str, dims: &[usize], data: &[f32]) -> String {
        let raw_data = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.graph.initializer.push(TensorProto {
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: FLOAT,
            name: name.into(),
            raw_data,
        });
        name.to_string()
    }

    /// A `Constant` node holding a 1-d int64 tensor (a shape): not an initializer, so the
    /// initializers stay the state dict's weights.
    pub fn constant_ints(&mut self, values: &[i64]) -> String {
        self.node("Constant", &[], vec![ints("value_ints", values)])
    }

    /// A `Constant` node holding an int64 scalar (an index).
    pub fn constant_int(&mut self, value: i64) -> String {
        self.node("Constant", &[], vec![int("value_int", value)])
    }

    /// A `Constant` node holding a float scalar.
    pub fn constant_float(&mut self, value: f32) -> String {
        self.node("Constant", &[], vec![float("value_float", value)])
    }

    /// Adds an `op_type` node and returns the name of its (single) output.
    pub fn node(
        &mut self,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> String {
        let output = format!("{}_{}", op_type.to_lowercase(), self.nodes_made);
        self.node_into(op_type, inputs, attributes, &output);
        output
    }

    fn node_into(
        &mut self,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
        output: &str,
    ) {
        self.graph.node.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.to_string()],
            name: format!("{op_type}_{}", self.nodes_made),
            op_type: op_type.into(),
            attribute: attributes,
            domain: String::new(),
        });
        self.nodes_made += 1;
    }

    /// The model around the graph, with `metadata` as its `metadata_props`.
    pub fn finish(self, doc: &str, metadata: &[(&str, String)]) -> ModelProto {
        ModelProto {
            ir_version: IR_VERSION,
            producer_name: "tandem".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            domain: String::new(),
            model_version: 1,
            doc_string: doc.into(),
            graph: Some(self.graph),
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: OPSET }],
            metadata_props: metadata
                .iter()
                .map(|(k, v)| StringStringEntryProto { key: k.to_string(), value: v.clone() })
                .collect(),
        }
    }
}

fn value_info(name: &str, dims: &[Dim]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match *d {
                Dim::Fixed(n) => DimensionValue::DimValue(n as i64),
                Dim::Named(s) => DimensionValue::DimParam(s.into()),
            }),
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorTypeProto {
                elem_type: FLOAT,
                shape: Some(TensorShapeProto { dim }),
            }),
        }),
    }
}

/// An `INTS` attribute.
pub fn ints(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: values.to_vec(),
        r#type: attribute_type::INTS,
        ..Default::default()
    }
}

/// An `INT` attribute.
pub fn int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i: Some(value),
        r#type: attribute_type::INT,
        ..Default::default()
    }
}

/// A `FLOAT` attribute.
pub fn float(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        f: Some(value),
        r#type: attribute_type::FLOAT,
        ..Default::default()
    }
}
