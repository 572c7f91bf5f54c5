//! TensorBoard event files (`events.out.tfevents.*`) with scalar summaries.
//!
//! Written by hand rather than through a protobuf crate: the format is a record framing
//! (length, masked CRC32C of the length, payload, masked CRC32C of the payload) around three
//! tiny protobuf messages, which is ~40 lines and needs no protoc at build time.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::events::{Event, Logger};

/// Appends scalar events to one TensorBoard event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<secs>.<host>.<pid>` and writes the file-version event.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{}.{}",
            unix_secs() as u64,
            host.trim(),
            std::process::id()
        );
        let path = dir.join(name);
        let mut w = EventWriter { out: BufWriter::new(File::create(&path)?), path };
        let mut event = Vec::new();
        put_double(&mut event, 1, unix_secs());
        put_bytes(&mut event, 3, b"brain.Event:2");
        w.write_record(&event)?;
        w.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar under `tag` at `step` (TensorBoard's `add_scalar`).
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> std::io::Result<()> {
        let mut summary_value = Vec::new();
        put_bytes(&mut summary_value, 1, tag.as_bytes());
        put_key(&mut summary_value, 2, 5);
        summary_value.extend_from_slice(&value.to_le_bytes());
        let mut summary = Vec::new();
        put_bytes(&mut summary, 1, &summary_value);
        let mut event = Vec::new();
        put_double(&mut event, 1, unix_secs());
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }

    fn write_record(&mut self, payload: &[u8]) -> std::io::Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(payload)?;
        self.out.write_all(&masked_crc(payload).to_le_bytes())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// The run's scalars: every 100th step's loss and learning rate, each epoch's figures, each
/// validation set's accuracy (tagged `verification/NAME`, as `tandem train --tensorboard` has
/// always written it).
impl Logger for EventWriter {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        let (step, values) = match event {
            Event::Step(s) if s.global_step.is_multiple_of(STEP_SCALARS_EVERY) => {
                let loss = s.loss.unwrap_or(f64::NAN);
                (
                    s.global_step,
                    vec![("train/loss_step".to_string(), loss), ("train/lr".into(), s.lr)],
                )
            }
            Event::EpochEnded { metrics: m, .. } => {
                let mut values = vec![
                    ("train/loss".to_string(), m.train_loss),
                    ("train/lr".into(), m.lr),
                    ("train/samples_per_s".into(), m.samples_per_s),
                ];
                if let (Some(loss), Some(accuracy)) = (m.eval_loss, m.eval_accuracy) {
                    values.extend([("eval/loss".into(), loss), ("eval/accuracy".into(), accuracy)]);
                }
                (m.step, values)
            }
            Event::Validated { step, results } => {
                let values =
                    results.iter().map(|r| (format!("verification/{}", r.name), r.accuracy));
                (*step, values.collect())
            }
            _ => return Ok(()),
        };
        let mut write = || -> std::io::Result<()> {
            for (tag, v) in &values {
                self.add_scalar(tag, *v as f32, step as i64)?;
            }
            self.flush()
        };
        write().map_err(|e| {
            let what = format!("writing TensorBoard events to {}: {e}", self.path.display());
            std::io::Error::new(e.kind(), what)
        })
    }
}

/// Steps between the per-step scalars (the trainer reads that step's loss back from a device
/// at once, so it is there to log).
pub const STEP_SCALARS_EVERY: u64 = 100;

/// Seconds since the Unix epoch (an event's wall time; 0 before 1970).
pub(crate) fn unix_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// TFRecord's CRC masking: rotate right by 15 and add a constant.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
    put_varint(out, ((field << 3) | wire_type) as u64);
}

fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow_reference() {
        // crc32c("") = 0 -> masked = 0xa282ead8; crc32c("a") = 0xc1d04330 (RFC 3720 test vectors).
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        assert_eq!(crc32c::crc32c(b"a"), 0xc1d0_4330);
        assert_eq!(masked_crc(b"a"), 0xc1d0_4330u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn records_are_framed_with_valid_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.add_scalar("train/loss", 0.5, 7).unwrap();
        w.flush().unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut pos = 0;
        let mut records = 0;
        while pos < bytes.len() {
            let len_bytes = &bytes[pos..pos + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap()),
                masked_crc(len_bytes)
            );
            let payload = &bytes[pos + 12..pos + 12 + len];
            let crc = u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(payload));
            pos += 16 + len;
            records += 1;
        }
        assert_eq!(records, 2);
    }
}
