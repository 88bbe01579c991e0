from django.urls import path

from webapp.accounts import views

urlpatterns = [path("", views.account, name="account")]
