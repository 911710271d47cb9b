//! Helpers shared by several test binaries (each includes this folder with `#[path]`).

// Each including binary uses a different part of this module.
#![allow(dead_code)]

pub mod disk;
