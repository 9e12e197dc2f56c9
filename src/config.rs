//! config placeholder
