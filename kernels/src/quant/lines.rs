//! Byte buffers that start on a cache line, for the int8 class's panels
//! and activation quants ([`super::i8`]).

/// A cache line of bytes.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// The byte types a [`Lines`] holds.
pub trait Byte: Copy {}
impl Byte for u8 {}
impl Byte for i8 {}

/// Bytes from a cache line's start (a `Vec<u8>` starts anywhere): a
/// panel's 64-byte rows and an activation row's quants then never split a
/// line, which would make each such load two.
pub struct Lines<T: Byte> {
    lines: Vec<Line>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Byte> Default for Lines<T> {
    fn default() -> Self {
        Lines {
            lines: Vec::new(),
            len: 0,
            _t: std::marker::PhantomData,
        }
    }
}

impl<T: Byte> Lines<T> {
    /// `len` bytes: those kept keep their values, new ones are zeros.
    pub fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(64), Line([0; 64]));
        self.len = len;
    }
}

impl<T: Byte> std::ops::Deref for Lines<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` bytes of initialized lines; `T` is a byte type
        // (any bit pattern is a value).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl<T: Byte> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}
