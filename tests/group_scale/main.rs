//! Work that does not grow with the fleet: lease-table reads, renewals spread over the
//! renew interval, and the lease rows created once at start-up.

mod creates;
mod reads;
mod renewals;
