//! numpy's `.npy` files (format 1.0) for the arrays tools hand to Python: a float32 matrix
//! (embeddings, as `np.save` of an `[N, E]` array) and a float64 vector (scores). Written
//! atomically, readable by `np.load`.
use std::path::Path;

use crate::error::CkptError;

/// `np.save(path, a)` of a float32 `[rows, cols]` matrix held row-major in `data`.
pub fn write_f32_matrix(
    path: &Path,
    data: &[f32],
    (rows, cols): (usize, usize),
) -> Result<(), CkptError> {
    assert_eq!(data.len(), rows * cols, "a [{rows}, {cols}] matrix");
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write(path, "<f4", &format!("({rows}, {cols})"), &bytes)
}

/// `np.save(path, v)` of a float64 vector.
pub fn write_f64_vector(path: &Path, data: &[f64]) -> Result<(), CkptError> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write(path, "<f8", &format!("({},)", data.len()), &bytes)
}

/// The file's bytes: magic, version, header length, a header dict padded with spaces so the
/// data starts on a 64-byte boundary, then the little-endian data in C order.
fn encode(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 6 + 2 + 2 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len());
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn write(path: &Path, descr: &str, shape: &str, data: &[u8]) -> Result<(), CkptError> {
    let bytes = encode(descr, shape, data);
    crate::atomic::write_atomic(path, |f| std::io::Write::write_all(f, &bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_starts_on_a_64_byte_boundary_after_numpys_header() {
        let bytes = encode("<f4", "(1, 2)", &[0; 8]);
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2), }"));
        assert!(header.ends_with('\n'));
        assert_eq!(bytes.len(), 10 + header_len + 8);
    }
}
