//! Length-prefixed frames (u32 little-endian length, then payload) with a hard size bound, and a
//! tiny field encoder/decoder for the store protocol and handshakes. Hand-written because the
//! protocol is six message kinds; a serialization framework would add more than it saves.
use std::io::{Read, Write};

/// Largest frame anyone will read: a corrupt or hostile length prefix cannot make a process
/// allocate more than this.
pub const MAX_FRAME: usize = 16 << 20;

#[derive(Debug)]
pub(crate) enum FrameError {
    Io(std::io::Error),
    TooLarge(u64),
}

pub(crate) fn write_frame(w: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("frame of {} bytes exceeds the {MAX_FRAME}-byte limit", payload.len()),
        ));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

pub(crate) fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    read_frame_at_most(r, MAX_FRAME)
}

/// The largest handshake frame (hello, challenge, proof): a stranger who has proved nothing
/// cannot make a server allocate more than this per connection.
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 4 << 10;

/// [`read_frame`] with a smaller bound (handshakes).
pub(crate) fn read_frame_at_most(r: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(FrameError::Io)?;
    let len = u32::from_le_bytes(len) as u64;
    if len > max as u64 {
        return Err(FrameError::TooLarge(len));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf).map_err(FrameError::Io)?;
    Ok(buf)
}

/// Appends fields to a payload.
#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads fields back; every read checks bounds (None = malformed).
pub(crate) struct Dec<'a>(pub &'a [u8]);

impl<'a> Dec<'a> {
    pub fn u8(&mut self) -> Option<u8> {
        let (&v, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(v)
    }
    pub fn u64(&mut self) -> Option<u64> {
        if self.0.len() < 8 {
            return None;
        }
        let (v, rest) = self.0.split_at(8);
        self.0 = rest;
        Some(u64::from_le_bytes(v.try_into().ok()?))
    }
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        if self.0.len() < 4 {
            return None;
        }
        let (len, rest) = self.0.split_at(4);
        let len = u32::from_le_bytes(len.try_into().ok()?) as usize;
        if rest.len() < len {
            return None;
        }
        let (v, rest) = rest.split_at(len);
        self.0 = rest;
        Some(v)
    }
    pub fn str(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?.to_vec()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_length_prefix_is_refused_without_allocating() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&u32::MAX.to_le_bytes());
        match read_frame(&mut wire.as_slice()) {
            Err(FrameError::TooLarge(n)) => assert_eq!(n, u32::MAX as u64),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn frames_and_fields_round_trip() {
        let payload = Enc::default().u8(3).u64(1 << 40).str("key").bytes(&[1, 2, 3]).0;
        let mut wire = Vec::new();
        write_frame(&mut wire, &payload).unwrap();
        let got = read_frame(&mut wire.as_slice()).unwrap();
        let mut d = Dec(&got);
        assert_eq!(d.u8(), Some(3));
        assert_eq!(d.u64(), Some(1 << 40));
        assert_eq!(d.str().as_deref(), Some("key"));
        assert_eq!(d.bytes(), Some(&[1u8, 2, 3][..]));
        assert_eq!(d.u8(), None);
        // truncated field: declared length beyond the payload
        let bad = Enc::default().u64(0).0;
        assert_eq!(Dec(&bad[..3]).bytes(), None);
    }
}
