"""The torch modules of families whose architecture is our own code (not in transformers or
diffusers): imported when a model is built or loaded, never when a recipe is read (the model
registry imports the family modules of stages/models/, not this folder)."""
