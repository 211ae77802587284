"""Learned draft heads on the target's hidden states (EAGLE-3, EAGLE-1/2, Medusa): their modules, and one reader per
checkpoint format mapping the files onto them."""
