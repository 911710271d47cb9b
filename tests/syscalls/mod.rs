//! The syscall-level power-loss check's parts: reading the trace, building crash images from
//! it, and checking a recovered store against the acknowledged calls.

pub mod check;
pub mod image;
pub mod trace;
