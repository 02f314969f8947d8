"""The engine: request state, scheduler, step loop, runner, vision encoder, sampling."""
