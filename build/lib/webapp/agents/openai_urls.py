from django.urls import path

from webapp.agents import openai_api

urlpatterns = [
    path("chat/completions", openai_api.chat_completions, name="openai-chat-completions"),
    path("models", openai_api.models, name="openai-models"),
]
