//! The embedded backend.
