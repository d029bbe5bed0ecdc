//! Reproducible test data without a dependency.

/// xorshift64*.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// A normal f16 of magnitude about 2^-5 .. 2^0, either sign.
    pub(crate) fn half(&mut self) -> [u8; 2] {
        let sign = (self.next() & 1) as u16;
        let exp = 10 + (self.next() % 6) as u16;
        let man = (self.next() & 0x3ff) as u16;
        ((sign << 15) | (exp << 10) | man).to_le_bytes()
    }
}
