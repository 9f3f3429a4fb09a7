"""What a trial costs: the meter (tok/s, MFU, peak), the estimate (predicted bytes), the
activation model and the profiler peak."""
