//! The README's examples, compiled and run as doctests.
#![doc = include_str!("../README.md")]
