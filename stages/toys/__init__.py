"""The toy tasks and their graders: arithmetic, toy VQA scenes, toy GenEval (prompts, scenes, a
detector) and toy video."""
