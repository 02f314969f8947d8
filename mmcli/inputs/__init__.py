"""Inputs: image and video files decoded, sized and patchified; prompts; engine requests."""
