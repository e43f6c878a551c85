"""The tier API (protos/cascade/tier/): what a coordinator and a tier server say to each other."""
