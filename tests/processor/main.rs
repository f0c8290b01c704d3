//! Processors (`produce_to`): the input's checkpoint never passes an input whose outputs
//! are not all stored, on the embedded backend and in a real process killed and restarted.

mod memory;
mod processes;
