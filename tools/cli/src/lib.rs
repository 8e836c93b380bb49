//! The CLI's pieces as a library, so tests and scripts share them.

pub mod dynamic;
pub mod mesh;
pub mod package;
pub mod render;
pub mod translate;
